"""megatron/core/dist_checkpointing/safe_pickle.py reads through megatron/core/dist_checkpointing/checkpoint_io.py: another
system's shard (a pickled argparse.Namespace beside its tensors) loads, and the same shard with a
flipped byte in a tensor is refused naming the file and the record."""

import argparse

import pytest
import torch

from megatron.core.dist_checkpointing.checkpoint_io import UnreadableFileError
from megatron.core.dist_checkpointing.safe_pickle import load_raw
from tests.helpers.checkpoint import flip_storage_byte


def test_foreign_shard_loads_and_a_flipped_byte_is_refused(tmp_path):
    path = str(tmp_path / "model_optim_rng.pt")
    weight = torch.arange(2048, dtype=torch.float32)
    torch.save({"args": argparse.Namespace(num_layers=2), "model": {"w": weight}}, path)
    state = load_raw(path)
    assert state["args"].num_layers == 2 and torch.equal(state["model"]["w"], weight)
    record = flip_storage_byte(path)
    with pytest.raises(UnreadableFileError, match=f"{path}: record {record} fails its CRC-32"):
        load_raw(path)
