"""Resharding a training checkpoint *with* its optimizer state (``--include-optimizer``): training
resumed at the new layout gives the losses of training resumed at the original one."""

import os

import numpy as np
import pytest
import torch

from megatron.checkpointing import CheckpointError, distrib_optim_filename
from tests.helpers.convert import convert
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import BASE, UNTIED, run_many


def _layout(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


@pytest.fixture(scope="module")
def trained(data_prefix, tmp_path_factory):
    """5 iterations at TP=2 x PP=1 saved, and the continuation to 10 at that layout."""
    root = tmp_path_factory.mktemp("optim_reshard")
    cache, ckpt = str(root / "cache"), str(root / "tp2")
    argv = BASE + ["--data-path", data_prefix, "--data-cache-path", cache] + UNTIED
    runs = [("first", argv + _layout(2, 1) + ["--save", ckpt, "--save-interval", "5",
                                              "--exit-interval", "5"]),
            ("same layout", argv + _layout(2, 1) + ["--load", ckpt])]
    out = run_distributed(2, run_many, runs, timeout=600)[1]
    return root, argv, ckpt, out


def test_resumes_at_new_layout_with_same_losses(trained):
    root, argv, ckpt, out = trained
    target = str(root / "tp1pp2")
    folder = convert("--loader", "megatron", "--saver", "megatron", "--load-dir", ckpt,
                     "--save-dir", target, "--target-tensor-parallel-size", 1,
                     "--target-pipeline-parallel-size", 2, "--include-optimizer")
    assert os.path.basename(folder) == "iter_0000005"
    shard = torch.load(os.path.join(folder, "mp_rank_00_001", "model_optim_rng.pt"), weights_only=True)
    assert shard["consumed_train_samples"] == 40 and shard["opt_param_scheduler"] is not None
    assert len(shard["optimizer"]["state"]) == len(shard["model"])
    runs = [("new layout", argv + _layout(1, 2) + ["--load", target, "--no-load-rng"])]
    new = run_distributed(2, run_many, runs, timeout=600)[1]["new layout"]
    same = out["same layout"]
    assert new["iteration"] == same["iteration"] == [6, 7, 8, 9, 10]
    np.testing.assert_allclose(new["lm loss"], same["lm loss"], rtol=1e-5)
    np.testing.assert_allclose(new["grad norm"], same["grad norm"], rtol=1e-5)
    # Without the optimizer state (fresh Adam moments) the continuation differs: the test has teeth.
    weights_only = str(root / "weights_only")
    convert("--loader", "megatron", "--saver", "megatron", "--load-dir", ckpt, "--save-dir",
            weights_only, "--target-pipeline-parallel-size", 2)
    runs = [("fresh adam", argv + _layout(1, 2) + ["--load", weights_only, "--finetune",
                                                   "--train-iters", "5"])]
    fresh = run_distributed(2, run_many, runs, timeout=600)[1]["fresh adam"]
    assert not np.allclose(fresh["lm loss"][1:], same["lm loss"][1:], rtol=1e-5)


def test_refusals(trained, tmp_path):
    root, _, ckpt, _ = trained
    with pytest.raises(SystemExit):  # HF has no optimizer state
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", root, "--save-dir",
                tmp_path / "a", "--include-optimizer")
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        convert("--loader", "megatron", "--saver", "megatron", "--load-dir", ckpt, "--save-dir",
                tmp_path / "b", "--include-optimizer", "--make-vocab-size-divisible-by", "96")
    distrib = tmp_path / "distrib"
    os.symlink(ckpt, distrib)  # same files plus a distributed-optimizer shard beside a model shard
    shard_dir = os.path.join(ckpt, "iter_0000005", "mp_rank_00")
    extra = os.path.join(shard_dir, distrib_optim_filename(0))
    open(extra, "wb").close()
    try:
        with pytest.raises(CheckpointError, match="--use-distributed-optimizer"):
            convert("--loader", "megatron", "--saver", "megatron", "--load-dir", distrib,
                    "--save-dir", tmp_path / "c", "--include-optimizer")
    finally:
        os.remove(extra)
    assert not os.path.exists(tmp_path / "c")
