"""Saving boxes with torch.distributed.checkpoint and reading them back at other layouts (2 ranks
save, 3 ranks and one process read); the checks of a save (coverage, one writer per box); a
metadata pickle or data-file name that would do more than describe a checkpoint is refused."""

import os
import pickle
import re

import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import storage
from megatron.core.dist_checkpointing.mapping import ParamSharding, ShardedTensor
from tests.helpers.dist import run_distributed

FULL = torch.arange(6 * 5, dtype=torch.float32).view(6, 5)  # a [6, 5] global tensor
EMB = torch.arange(8 * 2, dtype=torch.float32).view(8, 2)  # a "vocabulary" of 8 padded rows


def _save_two_ranks(directory):
    """Rank r holds rows 3r..3r+2 of "model.w" and the r-th half of the flattened "opt.w"
    (elements 0..14 or 15..29: a partial row at the cut), and all of the replicated "emb"."""
    r = dist.get_rank()
    boxes = ParamSharding.partition("w", (3, 5), 0, r, 2).boxes(FULL[3 * r:3 * r + 3].clone(),
                                                                "model.")
    whole = ParamSharding.partition("w", (6, 5), None, 0, 1)
    a, b = 15 * r, 15 * r + 15
    boxes += whole.flat_boxes(a, b, FULL.reshape(-1)[a:b] * 10, "opt.")
    boxes.append(ShardedTensor("emb", EMB.clone(), (8, 2), (0, 0), replica_id=r, resizable=True))
    storage.save(boxes, directory)
    return sorted(os.listdir(directory))


def _load_three_ranks(directory):
    """Rank r reads 11 elements of "opt.w" from 3r + 2 (crossing both saved halves for r=1), rows
    2r..2r+1 of "model.w", and rows of a 12-row padded "emb" (only the 8 saved are read)."""
    r = dist.get_rank()
    flat = torch.zeros(11)
    whole = ParamSharding.partition("w", (6, 5), None, 0, 1)
    boxes = whole.flat_boxes(3 * r + 2, 3 * r + 13, flat, "opt.")
    rows = torch.zeros(2, 5)
    boxes += ParamSharding.partition("w", (2, 5), 0, r, 3).boxes(rows, "model.")
    emb = torch.full((4, 2), -1.0)
    boxes.append(ShardedTensor("emb", emb, (12, 2), (4 * r, 0), resizable=True))
    storage.load(boxes, directory)
    assert torch.equal(flat, FULL.reshape(-1)[3 * r + 2:3 * r + 13] * 10)
    assert torch.equal(rows, FULL[2 * r:2 * r + 2])
    expected = torch.full((12, 2), -1.0)
    expected[:8] = EMB
    assert torch.equal(emb, expected[4 * r:4 * r + 4])  # rows 8..11 keep their values
    return True


def test_saved_at_one_layout_read_at_others(tmp_path):
    directory = str(tmp_path / "ckpt")
    files = run_distributed(2, _save_two_ranks, directory)[0]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    shapes = storage.tensor_shapes(storage.read_metadata(directory))
    assert shapes == {"model.w": ((6, 5), torch.float32), "opt.w": ((6, 5), torch.float32),
                      "emb": ((8, 2), torch.float32)}
    assert run_distributed(3, _load_three_ranks, directory) == [True] * 3
    whole = torch.zeros(6, 5)  # one process, no torch.distributed
    storage.load([ShardedTensor("opt.w", whole, (6, 5), (0, 0))], directory)
    assert torch.equal(whole, FULL * 10)


def test_missing_keys_and_other_shapes_are_named(tmp_path):
    directory = str(tmp_path)
    storage.save([ShardedTensor("model.w", FULL.clone(), (6, 5), (0, 0))], directory)
    with pytest.raises(storage.CheckpointFormatError,
                       match=r"holds no tensor model.x \(it holds e.g. \['model.w'\]\)"):
        storage.load([ShardedTensor("model.x", torch.zeros(6, 5), (6, 5), (0, 0))], directory)
    with pytest.raises(storage.CheckpointFormatError,
                       match=r"tensor model.w has global shape \[6, 5\] in the checkpoint but "
                             r"\[6, 4\] in the model"):
        storage.load([ShardedTensor("model.w", torch.zeros(6, 4), (6, 4), (0, 0))], directory)


def test_a_save_must_cover_each_tensor_once(tmp_path):
    with pytest.raises(ValueError, match=r"w: the boxes written cover 15 of the 30 elements"):
        storage.save([ShardedTensor("w", FULL[:3].clone(), (6, 5), (0, 0))], str(tmp_path / "a"))


def _both_write(directory):
    storage.save([ShardedTensor("w", FULL.clone(), (6, 5), (0, 0))], directory)


def test_a_box_claimed_by_two_ranks_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match=r"is written by ranks 0 and 1"):
        run_distributed(2, _both_write, str(tmp_path))


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_or_leave_the_folder_is_refused(tmp_path):
    directory = str(tmp_path)
    storage.save([ShardedTensor("w", FULL.clone(), (6, 5), (0, 0))], directory)
    path = os.path.join(directory, ".metadata")
    metadata = storage.read_metadata(directory)
    with open(path, "rb") as f:
        good = f.read()

    evil = _RunsCode()
    evil.marker = str(tmp_path / "ran")
    with open(path, "wb") as f:
        pickle.dump({"x": evil}, f)
    with pytest.raises(storage.CheckpointFormatError,
                       match=r"\.metadata asks to build posix\.system, which is not part of"):
        storage.read_metadata(directory)
    assert not os.path.exists(evil.marker)

    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../outside.distcp"
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(storage.CheckpointFormatError, match=r"names the data file '../outside"):
        storage.read_metadata(directory)

    with open(path, "wb") as f:
        f.write(good[:len(good) // 2])
    with pytest.raises(storage.CheckpointFormatError, match=r"cannot read .*\.metadata"):
        storage.read_metadata(directory)


def _save_one(directory, value):
    storage.save([ShardedTensor("model.w", torch.full((6, 5), float(value)), (6, 5), (0, 0))],
                 directory)


def _read_one(directory):
    box = torch.zeros(6, 5)
    storage.load([ShardedTensor("model.w", box, (6, 5), (0, 0))], directory, single_process=True)
    return box


def test_a_data_file_of_another_save_is_refused_naming_it(tmp_path):
    """Issue 31: two saves of one model at one layout have records at the same offsets with
    valid CRCs; before the save ids the copied-in file loaded silently (the other save's
    values)."""
    import shutil

    mine, other = str(tmp_path / "mine"), str(tmp_path / "other")
    _save_one(mine, 1)
    _save_one(other, 2)
    assert torch.equal(_read_one(mine), torch.full((6, 5), 1.0))
    shutil.copy(os.path.join(other, "__0_0.distcp"), os.path.join(mine, "__0_0.distcp"))
    with pytest.raises(storage.CheckpointFormatError,
                       match=r"mine/__0_0\.distcp comes from another save than .*mine/\.metadata "
                             r"\(save id [0-9a-f]{32}, expected [0-9a-f]{32}\)"):
        _read_one(mine)


def test_metadata_and_common_of_different_saves_are_refused_and_old_checkpoints_load(tmp_path,
                                                                                    monkeypatch):
    mine = str(tmp_path / "mine")
    _save_one(mine, 1)
    metadata = storage.read_metadata(mine)
    (record, mine_id, rank), = storage.save_ids(metadata).values()
    assert rank == 0 and storage.check_save_id(metadata, mine_id, mine) == []
    with pytest.raises(storage.CheckpointFormatError,
                       match=rf"mine/common\.pt and .*mine/\.metadata come from different saves "
                             rf"\(save id {'0' * 32} vs {mine_id}\)"):
        storage.check_save_id(metadata, "0" * 32, mine)
    assert metadata.storage_data[record].offset == 0  # first in the file
    old = str(tmp_path / "old")  # as written before the ids
    monkeypatch.setattr(storage, "_new_save_id", lambda: None)
    _save_one(old, 3)
    notes = storage.check_save_id(storage.read_metadata(old), None, old)
    assert len(notes) == 1 and "written before per-save ids" in notes[0]
    assert torch.equal(_read_one(old), torch.full((6, 5), 3.0))
    with pytest.raises(storage.CheckpointFormatError, match="come from different saves"):
        storage.check_save_id(storage.read_metadata(old), mine_id, old)  # common.pt of a new save


def _crafted(md, how):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    if how == "negative":
        md.size = torch.Size([-6, 5])
    elif how == "huge":  # torch.empty of it would ask for 4 TB
        md.size = torch.Size([10 ** 6, 10 ** 6])
    elif how == "box outside":
        md.chunks = [ChunkStorageMetadata(offsets=torch.Size([4, 0]), sizes=torch.Size([6, 5]))]
    elif how == "box bigger than its record":
        md.size = torch.Size([6000, 5])
        md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([6000, 5]))]


@pytest.mark.parametrize("how, why", [
    ("negative", r"has global shape \[-6, 5\]"),
    ("huge", r"has boxes covering 30 of the 1000000000000 elements"),
    ("box outside", r"has a box at \[4, 0\] of shape \[6, 5\] outside its global shape \[6, 5\]"),
    ("box bigger than its record", r"has a box at \[0, 0\] of shape \[6000, 5\] \(120000 bytes\) "
                                   r"in a record of \d+ bytes"),
])
def test_a_crafted_metadata_shape_is_refused_naming_the_tensor(tmp_path, how, why):
    """Issue 31: a crafted shape reached torch (torch.empty of a negative or huge shape) or DCP
    with their raw errors."""
    directory = str(tmp_path)
    storage.save([ShardedTensor("w", FULL.clone(), (6, 5), (0, 0))], directory)
    metadata = storage.read_metadata(directory)
    _crafted(metadata.state_dict_metadata["w"], how)
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(storage.CheckpointFormatError,
                       match=rf"\.metadata: tensor w {why}.*; the metadata is damaged or was crafted"):
        storage.read_metadata(directory)


def test_a_record_beyond_its_file_is_refused(tmp_path):
    directory = str(tmp_path)
    storage.save([ShardedTensor("w", FULL.clone(), (6, 5), (0, 0))], directory)
    metadata = storage.read_metadata(directory)
    info = metadata.storage_data[next(i for i in metadata.storage_data if i.fqn == "w")]
    info.offset = 10 ** 9
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(storage.CheckpointFormatError,
                       match=r"the record of w \(bytes 1000000000 \+ \d+\) does not lie inside "
                             r".*__0_0\.distcp \(\d+ bytes\)"):
        storage.read_metadata(directory)


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_checkpoint_file_that_is_a_named_pipe_is_refused_unopened(tmp_path, name):
    """Before: ``open`` of a piped ``__0_0.distcp`` waited for a writer forever."""
    directory = str(tmp_path / "ck")
    _save_one(directory, 1)
    os.remove(os.path.join(directory, name))
    os.mkfifo(os.path.join(directory, name))
    with pytest.raises(storage.CheckpointFormatError, match=re.escape(
            f"{os.path.join(directory, name)} is a named pipe, not a checkpoint file: it was not "
            "opened")):
        _read_one(directory)
