"""End to end: the MoE layouts added after tests/e2e/test_moe_layouts_e2e.py, each equal to one
process (losses, grad norms, validation losses and the logged router losses within rtol 1e-6;
fp32, dropout 0, clipping on every iteration) on the same model (4 experts, top-2, 3 MoE layers
of 4, grouped GEMM), in as few iterations and micro-batches as exercise the path (3 iterations,
2 micro-batches of 2 sequences per iteration at DP = 1, a validation at iteration 3):

- expert tensor parallelism: TP = 2 with expert-TP 2 (EP = 1), EP = 2 x TP = 2 with expert-TP 2
  (DP = 2), and expert-TP 2 at TP = 1 (the expert-TP group spans two DP ranks' micro-batches);
- TP x CP (TP = 2 with SP, CP = 2) and EP = 2 folded over CP = 2 alone;
- the sequence-wise load-balancing loss at EP = 2 x CP = 2 and TP = 2 x CP = 2;
- the global-batch load-balancing loss (``global_aux_loss``): at one process with 1, 2 or 4
  sequences per micro-batch, equal to the plain loss of one micro-batch holding the whole global
  batch (the independent oracle), and at DP = 2, EP = 2 over CP = 2, EP = 2 x PP = 2 x DP = 2
  with the distributed optimizer, and with 2 virtual stages per rank (1 sequence per
  micro-batch);
- full and selective recompute (with the expert bias, whose counts the replay must not add to);
- a router skewed so that every token picks experts 0 and 1 (EP rank 1 receives no token)
  with capacity 1.0 under both drop policies, and with padding to capacity.
"""

import numpy as np
import pytest

from tests.e2e.test_moe_e2e import CAPACITY, MOE
from tests.e2e.test_moe_layouts_e2e import BIAS, SIGMOID, SP, ep, run_skewed
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import LAYOUT_LR, UNTIED, assert_close_history, cp_args, e2e_argv, \
    layout_args, one_process, run_many

ITERS = 3
SHORT = ["--train-iters", str(ITERS), "--global-batch-size", "4", "--eval-interval", str(ITERS),
         "--eval-iters", "1", "--log-interval", "1"]
ETP2 = ["--expert-tensor-parallel-size", "2"]
SEQ_AUX = ["--moe-router-load-balancing-type", "seq_aux_loss"]
GLOBAL = ["--moe-router-load-balancing-type", "global_aux_loss"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]
SELECTIVE = ["--recompute-granularity", "selective"]
POSITION = ["--moe-token-drop-policy", "position"]
PAD = ["--moe-pad-expert-input-to-capacity"]
ROUTER_LOGS = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
               "z_loss")
COUNTS = ("tokens per expert min", "tokens per expert max", "dropped tokens")


def _argv(data_prefix, cache, *extra):
    return e2e_argv(data_prefix, cache, *LAYOUT_LR, *UNTIED, *MOE, *SHORT, *extra)


def _assert_equal_runs(got, want, name):
    assert_close_history(got, want, f"MoE {name}")
    for key in ROUTER_LOGS:
        if key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=f"{name}: {key}")
    for key in COUNTS:
        assert got[key] == want[key], (name, key)


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_more_cache1"))
    runs = [("dropless", _argv(data_prefix, cache)),
            ("capacity", _argv(data_prefix, cache, *CAPACITY)),
            ("seq aux", _argv(data_prefix, cache, *SEQ_AUX)),
            ("bias", _argv(data_prefix, cache, *SIGMOID, *BIAS)),
            ("full recompute", _argv(data_prefix, cache, *FULL)),
            ("selective recompute", _argv(data_prefix, cache, *SELECTIVE)),
            ("full recompute bias", _argv(data_prefix, cache, *SIGMOID, *BIAS, *FULL)),
            ("global", _argv(data_prefix, cache, *GLOBAL)),
            ("global mbs1", _argv(data_prefix, cache, *GLOBAL, "--micro-batch-size", "1")),
            ("global mbs4", _argv(data_prefix, cache, *GLOBAL, "--micro-batch-size", "4")),
            ("aux mbs4", _argv(data_prefix, cache, "--micro-batch-size", "4"))]
    return one_process(runs, timeout=900)


def test_moe_global_aux_loss_is_the_global_batch_loss(single):
    """``global_aux_loss`` with 2 or 4 micro-batches per iteration is the plain loss of one
    micro-batch holding the whole global batch: the same value (logged), gradient (grad norm)
    and training; it is not what averaging the per-micro-batch losses gives."""
    whole = single["aux mbs4"]
    for name in ("global", "global mbs1", "global mbs4"):
        assert_close_history(single[name], whole, f"MoE {name} vs one micro-batch")
        np.testing.assert_allclose(single[name]["global_load_balancing_loss"],
                                   whole["load_balancing_loss"], rtol=1e-6, err_msg=name)
    averaged = np.asarray(single["dropless"]["load_balancing_loss"])
    assert np.max(np.abs(averaged / whole["load_balancing_loss"] - 1)) > 1e-4


def test_moe_recompute_equals_no_recompute(single):
    """One process: full and selective recompute give the plain run's figures; with the expert
    bias the replayed forward adds no count (else the bias, and the run, would differ)."""
    assert "seq_load_balancing_loss" in single["seq aux"]
    for name in ("full recompute", "selective recompute"):
        _assert_equal_runs(single[name], single["dropless"], name)
    _assert_equal_runs(single["full recompute bias"], single["bias"], "full recompute bias")


def test_moe_two_rank_layouts_match_one_process(single, data_prefix, tmp_path_factory):
    """TP = 2 (SP) with expert-TP 2, expert-TP 2 at TP = 1 over DP = 2, EP = 2 over CP = 2, the
    sequence loss at EP = 2 x CP = 2, and full recompute with the expert bias at EP = 2."""
    cache = str(tmp_path_factory.mktemp("moe_more_cache2"))
    runs = [("tp2 etp2", _argv(data_prefix, cache, *layout_args(2, 1), "--sequence-parallel",
                               *ETP2)),
            ("etp2 dp2", _argv(data_prefix, cache, *ETP2)),
            ("etp2 dp2 capacity", _argv(data_prefix, cache, *ETP2, *CAPACITY)),
            ("ep2 cp2", _argv(data_prefix, cache, *cp_args(2), *ep(2))),
            ("ep2 cp2 seq aux", _argv(data_prefix, cache, *cp_args(2), *ep(2), *SEQ_AUX)),
            ("ep2 full recompute bias", _argv(data_prefix, cache, *ep(2), *SIGMOID, *BIAS,
                                              *FULL)),
            ("global dp2", _argv(data_prefix, cache, *GLOBAL)),
            ("global ep2 cp2", _argv(data_prefix, cache, *cp_args(2), *ep(2), *GLOBAL))]
    got = run_distributed(2, run_many, runs, timeout=1200)[-1]
    want = {"etp2 dp2 capacity": "capacity", "ep2 cp2 seq aux": "seq aux",
            "ep2 full recompute bias": "bias", "global dp2": "global",
            "global ep2 cp2": "global"}
    for name, _ in runs:
        _assert_equal_runs(got[name], single[want.get(name, "dropless")], name)


def test_moe_four_rank_layouts_match_one_process(single, data_prefix, tmp_path_factory):
    """EP = 2 x TP = 2 with expert-TP 2 (DP = 2, dropless and capacity 1.0), TP = 2 x CP = 2
    (EP = 1 with expert-TP 2; EP = 2 with expert-TP 1), and the sequence loss at TP x CP with
    selective recompute."""
    cache = str(tmp_path_factory.mktemp("moe_more_cache4"))
    tp2 = [*layout_args(2, 1), "--sequence-parallel"]
    runs = [("ep2 tp2 etp2", _argv(data_prefix, cache, *tp2, *ep(2), *ETP2)),
            ("ep2 tp2 etp2 capacity", _argv(data_prefix, cache, *tp2, *ep(2), *ETP2,
                                            *CAPACITY)),
            ("tp2 cp2", _argv(data_prefix, cache, *tp2, *cp_args(2))),
            ("tp2 cp2 ep2 etp1 capacity", _argv(data_prefix, cache, *tp2, *cp_args(2), *ep(2),
                                                "--expert-tensor-parallel-size", "1",
                                                *CAPACITY)),
            ("tp2 cp2 seq aux selective", _argv(data_prefix, cache, *tp2, *cp_args(2),
                                                *SEQ_AUX, *SELECTIVE)),
            ("global ep2 pp2 dp2 distopt", _argv(data_prefix, cache, *layout_args(1, 2),
                                                 *ep(2), *GLOBAL,
                                                 "--use-distributed-optimizer")),
            ("global ep2 pp2 virtual", _argv(data_prefix, cache, *layout_args(1, 2), *ep(2),
                                             *GLOBAL, "--num-layers-per-virtual-pipeline-stage",
                                             "1", "--micro-batch-size", "1"))]
    got = run_distributed(4, run_many, runs, timeout=1500)[-1]
    for name, _ in runs:
        want = next((w for w in ("capacity", "seq aux", "global") if w in name), "dropless")
        _assert_equal_runs(got[name], single[want], name)


def test_moe_skewed_router_with_drop_policies_and_padding(data_prefix, tmp_path_factory):
    """Every token picks experts 0 and 1, so EP rank 1 (experts 2, 3) receives no token; capacity
    1.0 drops half of their choices, by probability or by position, with and without padding
    every expert to its capacity; EP = 2 equals one process in each."""
    cache = str(tmp_path_factory.mktemp("moe_more_cache_skew"))
    runs = [("probs", _argv(data_prefix, cache, *CAPACITY)),
            ("position", _argv(data_prefix, cache, *CAPACITY, *POSITION)),
            ("probs pad", _argv(data_prefix, cache, *CAPACITY, *PAD)),
            ("position pad", _argv(data_prefix, cache, *CAPACITY, *POSITION, *PAD))]
    one = run_distributed(1, run_skewed, runs, timeout=900)[0]
    got = run_distributed(2, run_skewed, [(n, a + ep(2)) for n, a in runs], timeout=900)[-1]
    for name, _ in runs:
        _assert_equal_runs(got[name], one[name], f"skewed EP=2 {name}")
    # 2 micro-batches of 32 tokens, 3 MoE layers: experts 0 and 1 keep 16 of their 32 choices.
    assert one["probs"]["dropped tokens"] == [32.0 * 2 * 3] * ITERS
    assert one["probs"]["tokens per expert min"] == [0.0] * ITERS
    # the policies keep different choices; padding changes nothing
    assert one["position"]["lm loss"] != one["probs"]["lm loss"]
    assert one["probs pad"]["lm loss"] == one["probs"]["lm loss"]
    assert one["position pad"]["lm loss"] == one["position"]["lm loss"]


def test_a_pipeline_stage_without_moe_layers(data_prefix, tmp_path_factory):
    """``--moe-layer-freq [0,0,1,1]`` at PP = 2: stage 0 holds no expert; its empty expert part
    joins the expert norm and flag over ``tp_ep_pp`` (before, stage 1 waited for it forever), and
    both stages clip with the whole model's norm: one process's losses and grad norms, with the
    plain and the distributed optimizer."""
    cache = str(tmp_path_factory.mktemp("moe_stage_cache"))
    freq = ["--moe-layer-freq", "[0,0,1,1]"]
    want = one_process([("one", _argv(data_prefix, cache, *freq))], timeout=900)["one"]
    runs = [("pp2", _argv(data_prefix, cache, *freq, *layout_args(1, 2))),
            ("pp2 distopt", _argv(data_prefix, cache, *freq, *layout_args(1, 2),
                                  "--use-distributed-optimizer"))]
    got = run_distributed(2, run_many, runs, timeout=900)[-1]
    for name, _ in runs:
        _assert_equal_runs(got[name], want, name)
