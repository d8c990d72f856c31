"""End to end: pretrain_llama.py with mixture-of-experts layers (--num-experts 4
--moe-router-topk 2, load-balancing and z losses on) at PP=2 and at DP=2 gives one process's
losses, grad norms and validation losses (rtol 1e-6, 20 iterations, clipping on every one), with
and without a capacity that drops tokens. The layer is wired at TP = CP = EP = 1 (docs/moe.md)."""

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import (LAYOUT_ITERS, LAYOUT_LR, UNTIED, assert_close_history,
                                    e2e_argv, layout_args, run_many)

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-layer-freq", "[1,0,1,1]", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "1e-3", "--moe-grouped-gemm"]
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]


def _argv(data_prefix, cache, *extra):
    return e2e_argv(data_prefix, cache, "--train-iters", str(LAYOUT_ITERS), *LAYOUT_LR, *UNTIED,
                    *MOE, *extra)


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_cache1"))
    runs = [("dropless", _argv(data_prefix, cache)),
            ("capacity", _argv(data_prefix, cache, *CAPACITY))]
    return run_distributed(1, run_many, runs, timeout=900)[0]


def test_moe_trains_and_drops_change_the_run(single):
    losses = single["dropless"]["lm loss"]
    assert losses[-1] < losses[0]
    assert single["capacity"]["lm loss"] != losses


def test_moe_pp2_and_dp2_match_one_process(single, data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_cache2"))
    runs = [("pp2", _argv(data_prefix, cache, *layout_args(1, 2))),
            ("dp2", _argv(data_prefix, cache, *layout_args(1, 1))),
            ("dp2 capacity", _argv(data_prefix, cache, *layout_args(1, 1), *CAPACITY))]
    got = run_distributed(2, run_many, runs, timeout=900)[-1]
    assert_close_history(got["pp2"], single["dropless"], "MoE PP=2")
    assert_close_history(got["dp2"], single["dropless"], "MoE DP=2")
    assert_close_history(got["dp2 capacity"], single["capacity"], "MoE DP=2 capacity 1.0")
