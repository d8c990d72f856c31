"""Resharding our checkpoints: any TP/PP -> any TP/PP keeps the model (logits equal transformers'),
bad layouts and missing shards fail clearly."""

import os
import shutil

import pytest
import torch

from megatron.checkpointing import CheckpointError
from tests.helpers.convert import (assert_logits_match, convert, make_hf, megatron_logits,
                                   tokens_batch)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    model = make_hf(str(root / "hf"), tie=True, layers=4)
    with torch.no_grad():
        expected = model(tokens_batch()).logits
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", root / "hf", "--save-dir",
            root / "tp1pp4", "--target-pipeline-parallel-size", 4)
    return root, expected


@pytest.mark.parametrize("tp,pp", [(2, 2), (2, 1)])
def test_reshard_keeps_logits(source, tp, pp, tmp_path):
    root, expected = source
    convert("--loader", "megatron", "--saver", "megatron", "--load-dir", root / "tp1pp4",
            "--save-dir", tmp_path / "out", "--target-tensor-parallel-size", tp,
            "--target-pipeline-parallel-size", pp)
    assert_logits_match(megatron_logits(str(tmp_path / "out"), tp, pp, tokens_batch()), expected)


def test_reshard_to_bf16(source, tmp_path):
    root, _ = source
    convert("--loader", "megatron", "--saver", "megatron", "--load-dir", root / "tp1pp4",
            "--save-dir", tmp_path / "bf16", "--target-params-dtype", "bf16")
    path = tmp_path / "bf16" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    assert state["args"]["bf16"] and state["model"]["word_embeddings.weight"].dtype == torch.bfloat16


def test_bad_target_layout_and_missing_shard_fail_clearly(source, tmp_path):
    root, _ = source
    with pytest.raises(ValueError, match="--target-pipeline-parallel-size 3"):
        convert("--loader", "megatron", "--saver", "megatron", "--load-dir", root / "tp1pp4",
                "--save-dir", tmp_path / "x", "--target-pipeline-parallel-size", 3)
    broken = tmp_path / "broken"
    shutil.copytree(root / "tp1pp4", broken)
    shutil.rmtree(broken / "release" / "mp_rank_00_002")
    with pytest.raises(CheckpointError, match="incomplete"):
        convert("--loader", "megatron", "--saver", "megatron", "--load-dir", broken,
                "--save-dir", tmp_path / "y")
    with pytest.raises(CheckpointError, match="no optimizer state"):  # a release checkpoint
        convert("--loader", "megatron", "--saver", "megatron", "--load-dir", root / "tp1pp4",
                "--save-dir", tmp_path / "z", "--include-optimizer")
    assert not os.path.exists(tmp_path / "z")
