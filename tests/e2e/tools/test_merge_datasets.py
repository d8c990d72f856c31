"""tools/merge_datasets.py: concatenation with document boundaries, int64 offsets, bad inputs."""
import os
import shutil

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from tools.merge_datasets import main, merge


def _write(prefix, docs, dtype=np.uint16):
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


A = [[[1, 2, 3]], [[4], [5, 6]]]
B = [[[7]]]
C = [[[8, 9]], [[10]], [[]]]


def test_merge_equals_concatenation(tmp_path):
    prefixes = [_write(str(tmp_path / n), d) for n, d in (("a", A), ("b", B), ("c", C))]
    ds = merge(prefixes, str(tmp_path / "out" / "m"))
    seqs = [s for docs in (A, B, C) for doc in docs for s in doc]
    assert [a.tolist() for a in ds] == seqs
    assert ds.document_indices.tolist() == [0, 1, 3, 4, 5, 6, 7]
    assert ds.pointers.tolist() == [0, 6, 8, 12, 14, 18, 20]
    # one writer over all documents gives the same bytes: the merge is a plain concatenation
    whole = _write(str(tmp_path / "whole"), A + B + C)
    for ext in (".bin", ".idx"):
        assert open(whole + ext, "rb").read() == open(str(tmp_path / "out" / "m") + ext, "rb").read()


def test_folder_input_sorted_and_cli(tmp_path, capsys):
    folder = tmp_path / "shards"
    folder.mkdir()
    _write(str(folder / "s1"), B)
    _write(str(folder / "s0"), A)
    assert main(["--input", str(folder), "--output-prefix", str(tmp_path / "m")]) == 0
    assert "Merged 2 datasets" in capsys.readouterr().out
    ds = MMapIndexedDataset(str(tmp_path / "m"))
    assert [a.tolist() for a in ds] == [[1, 2, 3], [4], [5, 6], [7]]


def test_byte_offsets_beyond_2_31(tmp_path):
    """Offsets past 2 GiB are int64: a sparse .bin of 2^30 + 3 int32 tokens keeps its last sequence right."""
    prefix = str(tmp_path / "big")
    b = MMapIndexedDatasetBuilder(prefix + ".bin", np.int32)
    b.add_documents(np.zeros(0, np.int32), np.zeros(0, np.int64))
    b.sizes.extend([1 << 29, 1 << 29])  # 2 x 2 GiB of tokens, written below as a hole
    b.end_document()
    b.add_item([11, 12, 13])
    b.end_document()
    b._file.seek(0)
    b._file.truncate(1 << 32)
    b._file.seek(1 << 32)
    b._file.write(np.array([11, 12, 13], np.int32).tobytes())
    b.finalize(prefix + ".idx")
    ds = MMapIndexedDataset(prefix)
    assert ds.pointers.tolist() == [0, 1 << 31, 1 << 32]
    assert ds[2].tolist() == [11, 12, 13]


def test_mixed_dtypes_rejected(tmp_path, capsys):
    a = _write(str(tmp_path / "a"), A, np.uint16)
    b = _write(str(tmp_path / "b"), B, np.int32)
    assert main(["--input", a, b, "--output-prefix", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "different token dtypes" in err and "uint16" in err and "int32" in err
    assert not os.path.exists(str(tmp_path / "m.bin")) and not os.path.exists(str(tmp_path / "m.idx"))


def test_missing_and_corrupt_inputs(tmp_path, capsys):
    a = _write(str(tmp_path / "a"), A)
    assert main(["--input", a, str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "m")]) == 2
    assert "nope.bin" in capsys.readouterr().err
    shutil.copy(a + ".idx", tmp_path / "t.idx")
    open(tmp_path / "t.bin", "wb").write(b"\x00")
    assert main(["--input", a, str(tmp_path / "t"), "--output-prefix", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "t.bin" in err and "truncated" in err
    assert main(["--input", a, "--output-prefix", a]) == 2
    assert "one of the inputs" in capsys.readouterr().err
    assert not os.path.exists(str(tmp_path / "m.bin"))


def test_help_gives_the_whole_description(capsys):
    import pytest

    from tools import merge_datasets

    with pytest.raises(SystemExit):
        merge_datasets.get_args(["--help"])
    text = capsys.readouterr().out
    assert "keeping every document boundary (Megatron's\n``tools/merge_datasets.py``)." in text
    assert "--input is a folder" in text.replace("``", "") and "renamed when complete" in text
