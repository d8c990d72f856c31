"""``--include-optimizer`` for a model with experts at any ``--target-expert-parallel-size``: a
training checkpoint saved at EP=2 (plain optimizer: its dense and expert parts,
``chained_optimizers``) converts to EP=1, EP=4 and TP=2 x EP=2 x expert-TP 2 with the Adam moments of every expert moved
with the expert, and training resumed there gives the losses and grad norms of the run resumed
at its own layout (EP layouts equal one process within 1e-6: tests/e2e/test_moe_layouts_e2e.py)."""

import os

import numpy as np
import pytest
import torch

from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file
from tests.helpers.convert import convert
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import BASE, UNTIED, run_many

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-aux-loss-coeff", "0.01"]


def _ep(n):
    return ["--expert-model-parallel-size", str(n)]


@pytest.fixture(scope="module")
def trained(data_prefix, tmp_path_factory):
    """5 iterations at EP=2 (DP=2) saved, and the continuation to 10 at that layout."""
    root = tmp_path_factory.mktemp("moe_optim")
    ckpt = str(root / "ep2")
    argv = BASE + ["--data-path", data_prefix, "--data-cache-path", str(root / "cache")] + \
        UNTIED + MOE
    runs = [("first", argv + _ep(2) + ["--save", ckpt, "--save-interval", "5",
                                       "--exit-interval", "5"]),
            ("same layout", argv + _ep(2) + ["--load", ckpt])]
    out = run_distributed(2, run_many, runs, timeout=900)[1]
    return root, argv, ckpt, out


def _shard(folder, sub):
    return load_torch_file(os.path.join(folder, sub, "model_optim_rng.pt"), what="shard")


def test_expert_moments_move_with_their_experts(trained):
    """EP=2 -> EP=4: expert rank e's shard holds expert e's weights and Adam moments, those of
    the source's expert rank e // 2, row e % 2; the dense part is the source's."""
    root, _, ckpt, _ = trained
    folder = convert("--loader", "megatron", "--saver", "megatron", "--load-dir", ckpt,
                     "--save-dir", root / "ep4", "--target-expert-parallel-size", 4,
                     "--include-optimizer")
    assert os.path.basename(folder) == "iter_0000005"
    source = [_shard(os.path.join(ckpt, "iter_0000005"), f"mp_rank_00_{e:03d}") for e in range(2)]
    name = "layers.2.mlp.experts.weight1"
    for e in range(4):
        shard = _shard(folder, f"mp_rank_00_{e:03d}")
        dense, expert = shard["optimizer"]["chained_optimizers"]
        src_dense, src_expert = source[e // 2]["optimizer"]["chained_optimizers"]
        assert shard["args"]["expert_model_parallel_size"] == 4
        assert shard["model"][name].shape[0] == 1
        assert torch.equal(shard["model"][name][0], source[e // 2]["model"][name][e % 2])
        # expert part: params in model order (weight1, weight2 per layer): layer 2's weight1 is
        # the fifth
        for q in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(expert["state"][4][q][0], src_expert["state"][4][q][e % 2])
            assert all(torch.equal(dense["state"][i][q], src_dense["state"][i][q])
                       for i in src_dense["state"])
        assert float(expert["state"][4]["step"]) == 5.0
        assert shard["consumed_train_samples"] == 40


TP2_ETP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--expert-tensor-parallel-size", "2"]


@pytest.mark.parametrize("ep,tp,world", [(1, 1, 2), (4, 1, 4), (2, 2, 4)])
def test_resumes_at_another_expert_parallel_size_with_the_same_losses(trained, ep, tp, world):
    """EP=2 -> EP=1, EP=4, and TP=2 x EP=2 with expert-TP 2 (each expert's moments split over
    the tensor ranks like its weights)."""
    root, argv, ckpt, out = trained
    target = str(root / f"to_ep{ep}_tp{tp}")
    convert("--loader", "megatron", "--saver", "megatron", "--load-dir", ckpt, "--save-dir",
            target, "--target-expert-parallel-size", ep, "--include-optimizer",
            "--target-tensor-parallel-size", tp, "--target-expert-tensor-parallel-size", tp)
    layout = _ep(ep) + (TP2_ETP2 if tp == 2 else [])
    runs = [("new layout", argv + layout + ["--load", target, "--no-load-rng"])]
    new = run_distributed(world, run_many, runs, timeout=900)[world - 1]["new layout"]
    same = out["same layout"]
    assert new["iteration"] == same["iteration"] == [6, 7, 8, 9, 10]
    np.testing.assert_allclose(new["lm loss"], same["lm loss"], rtol=1e-5)
    np.testing.assert_allclose(new["grad norm"], same["grad norm"], rtol=1e-5)
    if ep == 1:  # fresh Adam moments (weights only) continue differently: the test has teeth
        weights = str(root / "weights_only")
        convert("--loader", "megatron", "--saver", "megatron", "--load-dir", ckpt, "--save-dir",
                weights, "--target-expert-parallel-size", ep)
        runs = [("fresh adam", argv + _ep(ep) + ["--load", weights, "--finetune",
                                                 "--train-iters", "5"])]
        fresh = run_distributed(world, run_many, runs, timeout=900)[world - 1]["fresh adam"]
        assert not np.allclose(fresh["lm loss"][1:], same["lm loss"][1:], rtol=1e-5)
