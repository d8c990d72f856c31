"""MMIDIDX writer/reader: round trip, header bytes against the format spec, validation errors."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    TOKEN_DTYPES, IndexedDataset, IndexedDatasetError, MMapIndexedDataset, MMapIndexedDatasetBuilder,
    best_fitting_dtype, data_file_path, index_file_path, remove_stale_temporaries)

from tests.helpers.paths import ROOT


def _write(prefix, docs, dtype=np.uint16):
    """docs: list of documents, each a list of sequences (lists of ids)."""
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(seq)
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return prefix


DOCS = [[[5, 6, 7]], [[1], [2, 3], []], [[9] * 10]]


@pytest.mark.parametrize("dtype", [np.dtype(d) for d in TOKEN_DTYPES.values()])
def test_round_trip_every_dtype(tmp_path, dtype):
    prefix = _write(str(tmp_path / "d"), DOCS, dtype)
    ds = MMapIndexedDataset(prefix)
    seqs = [s for doc in DOCS for s in doc]
    assert len(ds) == len(seqs) and ds.dtype == dtype
    for i, s in enumerate(seqs):
        assert ds[i].dtype == dtype and ds[i].tolist() == s
    assert ds.sizes.dtype == np.int32 and ds.sizes.tolist() == [len(s) for s in seqs]
    assert ds.document_indices.dtype == np.int64 and ds.document_indices.tolist() == [0, 1, 4, 5]
    assert ds.get(4, offset=2, length=3).tolist() == [9, 9, 9]
    assert ds.get(0, offset=1).tolist() == [6, 7]
    assert ds[-1].tolist() == [9] * 10
    assert [a.tolist() for a in ds[0:2]] == [[5, 6, 7], [1]]
    assert IndexedDataset is MMapIndexedDataset
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)


def test_header_bytes_follow_spec(tmp_path):
    prefix = _write(str(tmp_path / "d"), DOCS, np.int32)
    raw = open(index_file_path(prefix), "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == 4  # int32
    assert struct.unpack("<QQ", raw[18:34]) == (5, 4)
    sizes = np.frombuffer(raw, np.int32, 5, 34)
    pointers = np.frombuffer(raw, np.int64, 5, 34 + 20)
    doc_idx = np.frombuffer(raw, np.int64, 4, 34 + 20 + 40)
    assert sizes.tolist() == [3, 1, 2, 0, 10]
    assert pointers.tolist() == [0, 12, 16, 24, 24]  # byte offsets, 4 bytes per int32 token
    assert doc_idx.tolist() == [0, 1, 4, 5]
    assert len(raw) == 34 + 20 + 40 + 32
    assert os.path.getsize(data_file_path(prefix)) == 16 * 4


def test_add_document_and_add_documents_equal_add_item(tmp_path):
    a = _write(str(tmp_path / "a"), [[[1, 2], [3]], [[4]], [[5, 6, 7]]])
    b = MMapIndexedDatasetBuilder(str(tmp_path / "b.bin"), np.uint16)
    b.add_document([1, 2, 3], [2, 1])
    b.add_documents(np.array([4, 5, 6, 7]), np.array([1, 3]))
    b.finalize(str(tmp_path / "b.idx"))
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(str(tmp_path / "b") + ext, "rb").read()


def test_empty_dataset(tmp_path):
    ds = MMapIndexedDataset(_write(str(tmp_path / "e"), []))
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]


def test_add_index_concatenates(tmp_path):
    a = _write(str(tmp_path / "a"), DOCS)
    b = _write(str(tmp_path / "b"), [[[8, 8]]])
    m = MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    m.add_index(a)
    m.add_index(b)
    m.finalize(str(tmp_path / "m.idx"))
    ds = MMapIndexedDataset(str(tmp_path / "m"))
    assert ds.document_indices.tolist() == [0, 1, 4, 5, 6]
    assert ds[5].tolist() == [8, 8] and ds[4].tolist() == [9] * 10
    assert ds.pointers.tolist() == [0, 6, 8, 12, 12, 32]


def test_empty_documents_as_megatron_writes_them(tmp_path):
    """An empty document is an entry of document_indices without a sequence (Megatron-LM's
    add_document([], [])); add_documents with length 0 writes exactly that."""
    a = str(tmp_path / "a")
    builder = MMapIndexedDatasetBuilder(data_file_path(a), np.uint16)
    for tokens in ([1, 2], [], [3], [], []):
        builder.add_document(tokens, [len(tokens)] if tokens else [])
    builder.finalize(index_file_path(a))
    b = str(tmp_path / "b")
    builder = MMapIndexedDatasetBuilder(data_file_path(b), np.uint16)
    builder.add_documents(np.array([1, 2]), np.array([2, 0]))
    builder.add_documents(np.array([3]), np.array([1, 0, 0]))
    builder.finalize(index_file_path(b))
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(b + ext, "rb").read()
    ds = MMapIndexedDataset(b)
    assert ds.sizes.tolist() == [2, 1] and ds.document_indices.tolist() == [0, 1, 1, 2, 2, 2]
    assert ds.num_tokens == 3


def test_temporary_names_until_finalize(tmp_path):
    prefix = str(tmp_path / "t")
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), np.uint16)
    builder.add_item([1, 2])
    builder.end_document()
    assert not os.path.exists(data_file_path(prefix)) and not os.path.exists(index_file_path(prefix))
    builder.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        with MMapIndexedDatasetBuilder(data_file_path(prefix), np.uint16) as b2:
            b2.add_item([1])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def _corrupt(prefix, path, offset=None, data=None, truncate=None, append=None):
    if append is not None:
        with open(path, "ab") as f:
            f.write(append)
    elif truncate is not None:
        with open(path, "r+b") as f:
            f.truncate(truncate)
    else:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)


@pytest.mark.parametrize("what, kwargs, message", [
    ("idx", dict(offset=0, data=b"XX"), "magic"),
    ("idx", dict(offset=9, data=struct.pack("<Q", 2)), "version"),
    ("idx", dict(offset=17, data=bytes([9])), "dtype code"),
    ("idx", dict(truncate=40), "truncated"),
    ("idx", dict(truncate=10), "truncated"),
    ("idx", dict(offset=34 + 20 + 40, data=struct.pack("<q", 1)), "document indices"),
    ("idx", dict(offset=34 + 20, data=struct.pack("<q", 10 ** 6)), "sequence 0 starts at byte 1000000"),
    ("idx", dict(offset=34 + 20 + 8, data=struct.pack("<q", 13)), "sequence 1 starts at byte 13 .* put it at byte 12"),
    ("idx", dict(offset=34, data=struct.pack("<i", -3)), "sequence 0 has negative size -3"),
    ("idx", dict(offset=17, data=bytes([6])), r"dtype code 6 \(float64\) is not an integer type"),
    ("idx", dict(offset=17, data=bytes([7])), r"dtype code 7 \(float32\) is not an integer type"),
    # int32 data behind a uint16 header: pointers advance 4 bytes per token, the header says 2.
    ("idx", dict(offset=17, data=bytes([8])), r"sequence 1 starts at byte 12 .*uint16, 2 bytes per token.* byte 6"),
    ("bin", dict(truncate=10), "truncated"),
    ("bin", dict(append=b"\0\0\0\0"), "68 bytes, but .* describes 16 tokens of int32 \\(64 bytes\\); the .bin is longer"),
])
def test_bad_files_name_file_and_problem(tmp_path, what, kwargs, message):
    prefix = _write(str(tmp_path / "d"), DOCS, np.int32)
    path = index_file_path(prefix) if what == "idx" else data_file_path(prefix)
    _corrupt(prefix, path, **kwargs)
    with pytest.raises(IndexedDatasetError, match=message) as err:
        MMapIndexedDataset(prefix)
    assert path in str(err.value)


def test_leftovers_of_a_killed_writer_are_removed_and_live_writers_respected(tmp_path):
    """A temporary is removed only when it has our exact name form and its writer's lock is free;
    a live writer makes a second one refuse to start."""
    prefix = str(tmp_path / "d")
    bin_path = data_file_path(prefix)
    dead = bin_path + ".tmp-999999"           # a writer killed by SIGKILL leaves this, unlocked
    open(dead, "wb").write(b"partial")
    foreign = bin_path + ".tmp-notours"       # not our name form: never touched
    open(foreign, "wb").write(b"x")
    live = MMapIndexedDatasetBuilder(bin_path, np.uint16)  # cleans up, then writes under its lock
    assert not os.path.exists(dead) and os.path.exists(foreign)
    with pytest.raises(FileExistsError, match=r"another process is writing .*d\.bin"):
        remove_stale_temporaries(bin_path)
    live.add_item([1, 2])
    live.end_document()
    live.finalize(index_file_path(prefix))
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.bin.tmp-notours", "d.idx"]


def test_missing_file(tmp_path):
    prefix = _write(str(tmp_path / "d"), DOCS)
    os.remove(data_file_path(prefix))
    with pytest.raises(IndexedDatasetError, match="not found"):
        MMapIndexedDataset(prefix)


def test_best_fitting_dtype():
    assert best_fitting_dtype(32000) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(None) == np.int32


def test_reference_vector_reads(shared_data):
    ds = MMapIndexedDataset(os.path.join(shared_data, "megatron-lm-reference", "sample_text_document"))
    assert len(ds) == 200 and ds.dtype == np.uint16
    assert ds.document_indices.tolist() == list(range(201))
    assert all(int(ds[i][-1]) == 2 for i in range(len(ds)))  # EOD appended


def test_reading_does_not_grow_anonymous_memory(tmp_path):
    """A 64 MiB dataset read end to end: anonymous memory (RssAnon) grows far less than the data."""
    prefix = str(tmp_path / "big")
    b = MMapIndexedDatasetBuilder(data_file_path(prefix), np.int32)
    chunk = np.arange(1 << 20, dtype=np.int32)
    for _ in range(16):
        b.add_documents(chunk, np.full(16, 1 << 16))
    b.finalize(index_file_path(prefix))
    code = (
        "import sys, numpy as np\n"
        "from megatron.data.indexed_dataset import MMapIndexedDataset\n"
        "def anon():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('RssAnon:'): return int(line.split()[1])\n"
        "before = anon()\n"
        "ds = MMapIndexedDataset(sys.argv[1])\n"
        "total = sum(int(ds[i][-1]) for i in range(len(ds)))\n"
        "print(anon() - before)\n")
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc")
    out = subprocess.run([sys.executable, "-c", code, prefix], cwd=ROOT, capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) < 8 * 1024  # KiB; the data is 64 MiB


def test_import_does_not_load_torch():
    code = "import sys, megatron.data.indexed_dataset; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("which", ["idx", "bin"])
def test_a_dataset_file_that_is_a_named_pipe_is_named_as_such_unopened(tmp_path, which):
    """The fourth hostile pass: a pipe was said to be "file not found"."""
    import os

    from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset

    prefix = str(tmp_path / "d")
    for ext in ("idx", "bin"):
        (os.mkfifo if ext == which else lambda p: open(p, "wb").close())(f"{prefix}.{ext}")
    with pytest.raises(IndexedDatasetError, match=rf"d\.{which}: a named pipe, not a regular file "
                                                  r"\(it was not opened\)"):
        MMapIndexedDataset(prefix)


@pytest.mark.parametrize("which", ["bin", "idx"])
def test_an_output_name_that_is_a_folder_is_refused_before_anything_is_written(tmp_path, which):
    """The fourth hostile pass: the preprocessors tokenized everything, then failed with an
    IsADirectoryError traceback at the final rename."""
    import os

    from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDatasetBuilder

    os.mkdir(tmp_path / f"o.{which}")
    with pytest.raises(IndexedDatasetError, match=rf"o\.{which} is a folder: the output cannot "
                                                  "take its name"):
        MMapIndexedDatasetBuilder(str(tmp_path / "o.bin"))
    assert os.listdir(tmp_path) == [f"o.{which}"]
