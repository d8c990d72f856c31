"""End to end: pretrain_llama.py with mixture-of-experts layers (--num-experts 4
--moe-router-topk 2, load-balancing and z losses on) at PP=2 (with and without virtual stages)
and at DP=2 (with and without the distributed optimizer) gives one process's
losses, grad norms and validation losses (rtol 1e-6, 20 iterations, clipping on every one), with
and without a capacity that drops tokens; saved half-way at PP=2 (torch and torch_dist) and
resumed, it continues the uninterrupted run exactly. The layer is wired at TP = CP = EP = 1 (docs/moe.md)."""

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import (LAYOUT_ITERS, LAYOUT_LR, UNTIED, assert_close_history,
                                    e2e_argv, layout_args, one_process, run_many)

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-layer-freq", "[1,0,1,1]", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "1e-3", "--moe-grouped-gemm"]
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]
# validation at iterations 10 and 20 on one batch: its losses are compared, never averaged more
EVAL = ["--eval-interval", "10", "--eval-iters", "1"]
HALF = LAYOUT_ITERS // 2


def _argv(data_prefix, cache, *extra):
    """The MoE modules' run (test_moe_layouts_e2e.py and the modules built on it import it):
    the layout tests' 20 iterations and learning rate, untied embeddings."""
    return e2e_argv(data_prefix, cache, "--train-iters", str(LAYOUT_ITERS), *LAYOUT_LR, *UNTIED,
                    *EVAL, *MOE, *extra)


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_cache1"))
    runs = [("dropless", _argv(data_prefix, cache)),
            ("capacity", _argv(data_prefix, cache, *CAPACITY))]
    return one_process(runs, timeout=900)


def test_moe_trains_and_drops_change_the_run(single):
    losses = single["dropless"]["lm loss"]
    assert losses[-1] < losses[0]
    assert single["capacity"]["lm loss"] != losses


def test_moe_pp2_and_dp2_match_one_process(single, data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_cache2"))
    runs = [("pp2", _argv(data_prefix, cache, *layout_args(1, 2))),
            ("dp2", _argv(data_prefix, cache, *layout_args(1, 1))),
            ("dp2 capacity", _argv(data_prefix, cache, *layout_args(1, 1), *CAPACITY)),
            ("pp2 virtual", _argv(data_prefix, cache, *layout_args(1, 2),
                                  "--num-layers-per-virtual-pipeline-stage", "1")),
            ("dp2 distributed optimizer", _argv(data_prefix, cache, *layout_args(1, 1),
                                                "--use-distributed-optimizer"))]
    # Save half-way and stop, then resume to the end, in both checkpoint formats.
    for fmt in ("torch", "torch_dist"):
        ckpt = str(tmp_path_factory.mktemp(f"moe_ckpt_{fmt}"))
        common = ["--ckpt-format", fmt, *layout_args(1, 2)]
        runs.append((f"first {fmt}", _argv(data_prefix, cache, *common, "--save", ckpt,
                                           "--save-interval", str(HALF),
                                           "--exit-interval", str(HALF))))
        runs.append((f"second {fmt}", _argv(data_prefix, cache, *common, "--load", ckpt)))
    got = run_distributed(2, run_many, runs, timeout=900)[-1]
    assert_close_history(got["pp2"], single["dropless"], "MoE PP=2")
    assert_close_history(got["dp2"], single["dropless"], "MoE DP=2")
    assert_close_history(got["dp2 capacity"], single["capacity"], "MoE DP=2 capacity 1.0")
    assert_close_history(got["pp2 virtual"], single["dropless"], "MoE PP=2 x 2 virtual stages")
    assert_close_history(got["dp2 distributed optimizer"], single["dropless"],
                         "MoE DP=2 distributed optimizer")
    for fmt in ("torch", "torch_dist"):  # the resumed run continues the whole one exactly
        first, second = got[f"first {fmt}"], got[f"second {fmt}"]
        assert second["iteration"] == list(range(HALF + 1, LAYOUT_ITERS + 1))
        assert first["lm loss"] + second["lm loss"] == got["pp2"]["lm loss"], fmt
        assert first["grad norm"] + second["grad norm"] == got["pp2"]["grad norm"], fmt
