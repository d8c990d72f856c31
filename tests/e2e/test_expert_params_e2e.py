"""Expert parameters at EP = 1 through pretrain_llama.main(): the LLaMA model with every MLP
parameter marked as an expert parameter (its own buffers reduced over expert-DP, its own
optimizer part, its own torch_dist boxes) equals the run without marks, today's single-group
path, over 20 iterations that all clip: at TP=2 x DP=2 with the distributed optimizer and at
CP=2 x DP=2 (rtol 1e-6; the slow test: TP=2 PP=2 DP=2). The marked TP=2 x DP=2 run's torch_dist
checkpoint (iteration 10) resumes at PP=2 x DP=2 with the plain optimizer and continues as the
uninterrupted run at that layout; its legacy checkpoint resumes at TP=2 x DP=2 bitwise."""

import numpy as np
import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.experts import run_with_mlp_experts
from tests.helpers.pretrain import (CP_BASE, LAYOUT_ITERS, LAYOUT_LR, UNTIED, assert_close_history,
                                    cp_args, e2e_argv, history_tail, layout_args, run_many)

ITERS = ["--train-iters", str(LAYOUT_ITERS), *LAYOUT_LR, "--eval-interval", "10",
         "--eval-iters", "1"]
DISTOPT = ["--use-distributed-optimizer"]
TORCH_DIST = ["--ckpt-format", "torch_dist"]


@pytest.fixture(scope="module")
def runs(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("expert_cache"))
    save = str(tmp_path_factory.mktemp("expert_ckpt") / "ckpt")
    legacy = str(tmp_path_factory.mktemp("expert_legacy") / "ckpt")
    tp2 = e2e_argv(data_prefix, cache, *ITERS, *UNTIED, *layout_args(2, 1), *DISTOPT)
    cp2 = e2e_argv(data_prefix, cache, *CP_BASE, *cp_args(2))
    pp2 = e2e_argv(data_prefix, cache, *ITERS, *UNTIED, *layout_args(1, 2))
    marked = run_distributed(4, run_with_mlp_experts, [
        ("tp2", tp2),
        ("tp2 first half", tp2 + TORCH_DIST + ["--save", save, "--save-interval", "10",
                                               "--exit-interval", "10"]),
        ("cp2", cp2),
        ("pp2 resumed", pp2 + ["--load", save, "--ckpt-format", "torch_dist"]),
        ("pp2", pp2),
        # the legacy format: the chained optimizer's parts, DP shards merged per rank's file
        ("tp2 legacy first half", tp2 + ["--save", legacy, "--save-interval", "10",
                                         "--exit-interval", "10"]),
        ("tp2 legacy resumed", tp2 + ["--load", legacy])], timeout=900)[3]
    plain = run_distributed(4, run_many, [("tp2", tp2), ("cp2", cp2)], timeout=900)[3]
    return marked, plain


def test_marked_mlp_takes_the_expert_paths(runs):
    marked, _ = runs
    # Rank 3 (the last): TP=2 x DP=2 -> dp_cp = expt_dp = [1, 3]; CP=2 x DP=2 -> [0, 1, 2, 3];
    # PP=2 x DP=2 -> [2, 3]. Dense and expert buffers each, two optimizer parts.
    for name, ranks in (("tp2", (1, 3)), ("cp2", (0, 1, 2, 3)), ("pp2", (2, 3))):
        _, buffers, parts = marked[name]
        assert buffers == [(False, ranks), (True, ranks)], name
        assert parts == [False, True], name


def test_marked_equals_single_group_path(runs):
    marked, plain = runs
    for name in ("tp2", "cp2"):
        assert len(marked[name][0]["lm loss"]) == LAYOUT_ITERS
        assert_close_history(marked[name][0], plain[name], f"{name} marked", rtol=1e-6)


def test_marked_legacy_checkpoint_resumes_as_uninterrupted(runs):
    marked, _ = runs
    resumed, whole = marked["tp2 legacy resumed"][0], marked["tp2"][0]
    assert resumed["iteration"] == list(range(11, LAYOUT_ITERS + 1))
    tail = history_tail(whole, 11)
    # the same layout and reduction order: bitwise
    assert resumed["lm loss"] == tail["lm loss"] and resumed["grad norm"] == tail["grad norm"]


def test_marked_torch_dist_checkpoint_resumes_at_another_layout(runs):
    marked, _ = runs
    resumed, whole = marked["pp2 resumed"][0], marked["pp2"][0]
    assert resumed["iteration"] == list(range(11, LAYOUT_ITERS + 1))
    tail = history_tail(whole, 11)
    np.testing.assert_allclose(resumed["lm loss"], tail["lm loss"], rtol=1e-6)
    np.testing.assert_allclose(resumed["grad norm"], tail["grad norm"], rtol=1e-5)
    np.testing.assert_allclose([v for _, v in resumed["valid"]], [v for _, v in tail["valid"]],
                               rtol=1e-6)


@pytest.mark.slow
def test_marked_equals_single_group_path_at_tp2_pp2_dp2(data_prefix, tmp_path):
    """8 ranks, the distributed optimizer: dense and expert parts each sharded over DP = 2."""
    argv = e2e_argv(data_prefix, str(tmp_path / "cache"), *ITERS, *layout_args(2, 2), *DISTOPT)
    marked = run_distributed(8, run_with_mlp_experts, [("tp2 pp2 dp2", argv)], timeout=1200)[7]
    plain = run_distributed(8, run_many, [("tp2 pp2 dp2", argv)], timeout=1200)[7]
    history, buffers, parts = marked["tp2 pp2 dp2"]
    assert buffers == [(False, (5, 7)), (True, (5, 7))] and parts == [False, True]
    assert len(history["lm loss"]) == LAYOUT_ITERS
    assert_close_history(history, plain["tp2 pp2 dp2"], "TP=2 PP=2 DP=2 marked", rtol=1e-6)
