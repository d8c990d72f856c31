"""End to end: pretrain_llama.py with mixture-of-experts layers (tests/e2e/test_moe_e2e.py's
model: 4 experts, top-2, load-balancing and z losses, grouped GEMM) with the experts spread over
expert-parallel ranks gives one process's losses, grad norms and validation losses (rtol 1e-6,
fp32, dropout 0, every iteration clipped): EP=2 (folded over DP=2), EP=4 (over DP=4), EP=2 x
TP=2 with sequence parallelism (expert-TP 1), EP=2 x PP=2, EP=2 x DP=2 with the distributed
optimizer, EP=2 x CP=2, and a router skewed so that every token goes to one expert (the other
EP ranks receive no token); dropless and with capacity 1.0. The slow tier adds EP=4 with capacity
1.0, EP=2 x PP=2 with virtual stages and EP=4 folded over CP=2 x DP=2."""

import numpy as np
import pytest

# _argv and EVAL are the MoE modules' run (test_llama4_layouts_e2e.py imports EVAL from here)
from tests.e2e.test_moe_e2e import CAPACITY, EVAL, MOE, _argv  # noqa: F401
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import (LAYOUT_ITERS, LAYOUT_LR, UNTIED, assert_close_history,
                                    cp_args, e2e_argv, layout_args, one_process, run_many)

SP = ["--sequence-parallel", "--expert-tensor-parallel-size", "1"]
DISTOPT = ["--use-distributed-optimizer"]
SIGMOID = ["--moe-router-score-function", "sigmoid"]
BIAS = ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01"]
HALF = LAYOUT_ITERS // 2
# tokens of one global batch (8 sequences of 16) and of one micro-batch (2 of 16); MoE layers
GLOBAL_TOKENS, MICRO_TOKENS, MOE_LAYERS = 128, 32, 3


def ep(n):
    return ["--expert-model-parallel-size", str(n)]


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_layouts_cache1"))
    ckpt = str(tmp_path_factory.mktemp("moe_layouts_bias_ckpt"))
    runs = [("dropless", _argv(data_prefix, cache)),
            ("capacity", _argv(data_prefix, cache, *CAPACITY)),
            ("sigmoid", _argv(data_prefix, cache, *SIGMOID)),
            ("bias", _argv(data_prefix, cache, *SIGMOID, *BIAS)),
            # the bias is a saved buffer: a resumed run continues the whole one bitwise
            ("bias first", _argv(data_prefix, cache, *SIGMOID, *BIAS, "--save", ckpt,
                                 "--save-interval", str(HALF), "--exit-interval", str(HALF))),
            ("bias second", _argv(data_prefix, cache, *SIGMOID, *BIAS, "--load", ckpt))]
    return one_process(runs, timeout=900)


def test_moe_ep2_matches_one_process(single, data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_layouts_cache2"))
    runs = [("ep2", _argv(data_prefix, cache, *ep(2), "--moe-per-layer-logging")),
            ("ep2 capacity", _argv(data_prefix, cache, *ep(2), *CAPACITY)),
            ("ep2 bias", _argv(data_prefix, cache, *ep(2), *SIGMOID, *BIAS))]
    got = run_distributed(2, run_many, runs, timeout=900)[-1]
    assert_close_history(got["ep2"], single["dropless"], "MoE EP=2")
    assert_close_history(got["ep2 capacity"], single["capacity"], "MoE EP=2 capacity 1.0")
    assert_close_history(got["ep2 bias"], single["bias"], "MoE EP=2 expert bias")
    # the logged router losses: the one process's, and the per-layer ones sum to the total
    for name in ("load_balancing_loss", "z_loss"):
        np.testing.assert_allclose(got["ep2"][name], single["dropless"][name], rtol=1e-6)
        per_layer = [got["ep2"][f"{name} layer {n}"] for n in (1, 3, 4)]
        np.testing.assert_allclose(np.sum(per_layer, axis=0), got["ep2"][name], rtol=1e-12)
        assert f"{name} layer 2" not in got["ep2"]  # a dense layer
    assert got["ep2"]["dropped tokens"] == [0.0] * LAYOUT_ITERS
    assert got["ep2 capacity"]["dropped tokens"] == single["capacity"]["dropped tokens"]


def test_moe_expert_bias_updates_and_resumes(single):
    # the update moves the routing (else the run would be the plain sigmoid router's)
    assert single["bias"]["lm loss"][1:] != single["sigmoid"]["lm loss"][1:]
    first, second = single["bias first"], single["bias second"]
    assert second["iteration"] == list(range(HALF + 1, LAYOUT_ITERS + 1))
    assert first["lm loss"] + second["lm loss"] == single["bias"]["lm loss"]
    assert first["grad norm"] + second["grad norm"] == single["bias"]["grad norm"]


def run_skewed(runs):
    """:func:`run_many` with every router's logits of experts 0 and 1 raised by 30: every token
    picks them (top-2), so the EP ranks holding experts 2 and 3 receive no token."""
    from megatron.core.transformer.moe.router import TopKRouter

    plain = TopKRouter.logits

    def skewed(self, x):
        logits = plain(self, x)
        return logits + torch.tensor([30.0, 30.0, 0.0, 0.0], dtype=logits.dtype)

    import torch
    TopKRouter.logits = skewed
    try:
        return run_many(runs)
    finally:
        TopKRouter.logits = plain


def test_moe_skewed_router_zero_token_ranks_match_one_process(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_layouts_cache_skew"))
    one = run_distributed(1, run_skewed, [("skewed", _argv(data_prefix, cache))], timeout=900)[0]
    runs = [("ep2", _argv(data_prefix, cache, *ep(2))),
            ("ep2 capacity", _argv(data_prefix, cache, *ep(2), *CAPACITY))]
    got = run_distributed(2, run_skewed, runs, timeout=900)[-1]
    assert_close_history(got["ep2"], one["skewed"], "MoE EP=2 skewed (rank 1 gets no token)")
    # Every token chooses experts 0 and 1: per layer they get all 128 tokens, 2 and 3 none.
    dropless, capacity = got["ep2"], got["ep2 capacity"]
    assert dropless["tokens per expert max"] == [float(GLOBAL_TOKENS)] * LAYOUT_ITERS
    assert dropless["tokens per expert min"] == [0.0] * LAYOUT_ITERS
    assert dropless["dropped tokens"] == [0.0] * LAYOUT_ITERS
    # Capacity 1.0: 32 * 2 / 4 = 16 choices per expert and micro-batch; experts 0 and 1 keep 16
    # of their 32 each: 32 dropped per micro-batch and layer, 4 micro-batches, 3 layers.
    assert capacity["tokens per expert max"] == [4 * 16.0] * LAYOUT_ITERS
    assert capacity["dropped tokens"] == [32.0 * 4 * MOE_LAYERS] * LAYOUT_ITERS
    assert capacity["lm loss"] != dropless["lm loss"]


def _assert_four_rank_runs(single, data_prefix, cache, runs):
    """``runs`` in one 4-rank world, each equal to its one-process run: the capacity run for
    capacity-factor runs (and EP=4 over CP=2 x DP=2, which uses it), else the dropless one."""
    got = run_distributed(4, run_many, runs, timeout=1500)[-1]
    for name, _ in runs:
        want = single["capacity" if "capacity" in name or name == "ep4 cp2 dp2" else "dropless"]
        assert_close_history(got[name], want, f"MoE {name}")
        # the logged router losses and routing counts are the one process's too
        for key in ("load_balancing_loss", "z_loss"):
            np.testing.assert_allclose(got[name][key], want[key], rtol=1e-6, err_msg=name)
        for key in ("tokens per expert min", "tokens per expert max", "dropped tokens"):
            assert got[name][key] == want[key], (name, key)


def test_moe_four_rank_layouts_match_one_process(single, data_prefix, tmp_path_factory):
    """EP=4, EP=2 x TP=2 (SP, expert-TP 1), EP=2 x PP=2, EP=2 x DP=2 with the distributed
    optimizer (and its CPU offload) and EP=2 x CP=2, in one 4-rank world."""
    cache = str(tmp_path_factory.mktemp("moe_layouts_cache4"))
    _assert_four_rank_runs(single, data_prefix, cache, [
        ("ep4", _argv(data_prefix, cache, *ep(4))),
        ("ep2 tp2", _argv(data_prefix, cache, *layout_args(2, 1), *SP, *ep(2))),
        ("ep2 pp2", _argv(data_prefix, cache, *layout_args(1, 2), *ep(2))),
        ("ep2 dp2 distopt", _argv(data_prefix, cache, *ep(2), *DISTOPT)),
        ("ep2 dp2 distopt offload", _argv(data_prefix, cache, *ep(2), *DISTOPT,
                                          "--optimizer-cpu-offload")),
        ("ep2 cp2", _argv(data_prefix, cache, *cp_args(2), *ep(2)))])


@pytest.mark.slow
def test_moe_four_rank_cross_products_match_one_process(single, data_prefix, tmp_path_factory):
    """Cross products whose parts the default tier runs (capacity 1.0 at EP=2 above; EP=2 x PP=2
    with 2 virtual stages and EP=2 folded over CP=2 in test_moe_layouts_more_e2e.py): EP=4 with
    capacity 1.0, EP=2 x PP=2 with 2 virtual stages each, EP=4 over CP=2 x DP=2 (capacity 1.0)."""
    cache = str(tmp_path_factory.mktemp("moe_layouts_cache4x"))
    _assert_four_rank_runs(single, data_prefix, cache, [
        ("ep4 capacity", _argv(data_prefix, cache, *ep(4), *CAPACITY)),
        ("ep2 pp2 virtual", _argv(data_prefix, cache, *layout_args(1, 2), *ep(2),
                                  "--num-layers-per-virtual-pipeline-stage", "1")),
        ("ep4 cp2 dp2", _argv(data_prefix, cache, *cp_args(2), *ep(4), *CAPACITY))])


@pytest.mark.slow
def test_moe_tp2_ep2_pp2_matches_one_process(single, data_prefix, tmp_path_factory):
    """8 ranks: TP=2 (SP) x EP=2 x PP=2, DP=2, the distributed optimizer, with expert-TP 1 and
    with expert-TP 2 (Megatron-Core's default, TP: each expert split over the TP pair)."""
    cache = str(tmp_path_factory.mktemp("moe_layouts_cache8"))
    runs = [("tp2 ep2 pp2", _argv(data_prefix, cache, *layout_args(2, 2), *SP, *ep(2),
                                  *DISTOPT)),
            ("tp2 ep2 pp2 etp2", _argv(data_prefix, cache, *layout_args(2, 2),
                                       "--sequence-parallel", *ep(2), *DISTOPT))]
    got = run_distributed(8, run_many, runs, timeout=1800)[-1]
    assert_close_history(got["tp2 ep2 pp2"], single["dropless"], "MoE TP=2 x EP=2 x PP=2")
    assert_close_history(got["tp2 ep2 pp2 etp2"], single["dropless"],
                         "MoE TP=2 x EP=2 x PP=2, expert-TP 2")


def test_moe_figures_reach_tensorboard(data_prefix, tmp_path):
    """The MoE figures of each iteration are TensorBoard scalars (W&B takes the same dict), equal
    to the values the run recorded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    argv = e2e_argv(data_prefix, str(tmp_path / "cache"), "--train-iters", "3", *LAYOUT_LR,
                    *UNTIED, *MOE, *CAPACITY, "--moe-per-layer-logging", "--tensorboard-dir", tb)
    history = run_distributed(1, run_many, [("run", argv)], timeout=600)[0]["run"]
    events = EventAccumulator(tb)
    events.Reload()
    tags = events.Tags()["scalars"]
    for name in ("load_balancing_loss", "z_loss", "load_balancing_loss layer 3",
                 "tokens per expert min", "tokens per expert max", "dropped tokens"):
        assert name in tags, name
        logged = [e.value for e in events.Scalars(name)]
        np.testing.assert_allclose(logged, history[name], rtol=1e-6, err_msg=name)
