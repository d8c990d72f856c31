"""megatron/core/dist_checkpointing/checkpoint_io.py: the one reader of torch.save files. Damaged files are found by their
zip CRCs (which torch.load does not check), pickles naming code are refused naming the file and
the globals, and no message suggests weights_only=False."""

import argparse
import os
import pickle

import pytest
import torch

from megatron.core.dist_checkpointing.checkpoint_io import (UnreadableFileError, load_torch_file,
                                                          verify_checksums)
from tests.helpers.checkpoint import flip_storage_byte


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo ran",))


def _saved(path, obj, **kw):
    torch.save(obj, str(path), **kw)
    return str(path)


@pytest.mark.parametrize("mmap", [False, True])
def test_flipped_storage_byte_is_refused_naming_file_and_record(tmp_path, mmap):
    weights = {"w": torch.arange(4096, dtype=torch.float32)}
    path = _saved(tmp_path / "w.pt", weights)
    assert torch.equal(load_torch_file(path, mmap=mmap)["w"], weights["w"])
    record = flip_storage_byte(path)
    # torch itself loads the damaged file without a word: the reason for the check
    assert not torch.equal(torch.load(path, weights_only=True, mmap=mmap)["w"], weights["w"])
    with pytest.raises(UnreadableFileError) as err:
        load_torch_file(path, what="checkpoint shard", mmap=mmap)
    message = str(err.value)
    assert f"cannot read checkpoint shard {path}: record {record} fails its CRC-32" in message
    with pytest.raises(UnreadableFileError, match="fails its CRC-32"):
        verify_checksums(path)
    assert load_torch_file(path, verify=False)["w"].numel() == 4096  # the opt-out is explicit


def test_files_written_without_crcs_still_load(tmp_path):
    torch.serialization.set_crc32_options(False)
    try:
        path = _saved(tmp_path / "nocrc.pt", {"w": torch.ones(8)})
    finally:
        torch.serialization.set_crc32_options(True)
    assert torch.equal(load_torch_file(path)["w"], torch.ones(8))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's, for the bare pickle
@pytest.mark.parametrize("how", ["zip", "legacy", "bare pickle"])
def test_pickle_naming_code_is_refused_naming_the_global(tmp_path, how):
    path = str(tmp_path / "evil.pt")
    obj = {"w": torch.ones(2), "x": _Evil()}
    if how == "bare pickle":
        with open(path, "wb") as f:
            pickle.dump(obj, f)
    else:
        torch.save(obj, path, _use_new_zipfile_serialization=how == "zip")
    with pytest.raises(UnreadableFileError) as err:
        load_torch_file(path, what="weights file")
    message = str(err.value)
    assert message.startswith(f"refused to load weights file {path}: its pickle asks for ")
    assert f"{os.system.__module__}.system" in message and "nothing in it ran" in message
    assert "weights_only" not in message and "\n" not in message


def test_extra_globals_are_built_and_nothing_else(tmp_path):
    path = _saved(tmp_path / "ns.pt", {"args": argparse.Namespace(lr=0.1), "w": torch.ones(1)})
    with pytest.raises(UnreadableFileError, match=r"asks for argparse\.Namespace"):
        load_torch_file(path)
    loaded = load_torch_file(path, extra_globals=[argparse.Namespace], mmap=True)
    assert loaded["args"].lr == 0.1


def test_missing_truncated_and_not_torch_files_are_named(tmp_path):
    path = _saved(tmp_path / "t.pt", {"w": torch.ones(1000)})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    for file, expected in ((path, "truncated or corrupt"), (str(junk), "truncated or corrupt"),
                           (str(tmp_path / "none.pt"), "does not exist")):
        with pytest.raises(UnreadableFileError) as err:
            load_torch_file(file, what="shard")
        assert f"shard {file}" in str(err.value) and expected in str(err.value)
        assert "weights_only" not in str(err.value)
