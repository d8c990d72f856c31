"""End to end: pretrain_llama.py with Llama 4's text architecture (a MoE layer every other layer
with a top-1 sigmoid router on the expert input and a shared expert, dense layers between; a
NoPE layer every other layer with temperature-scaled queries; chunked attention of 5 tokens with
the q/k L2 norm and interleaved RoPE on the others) gives one process's losses, grad norms and
validation losses (rtol 1e-6, fp32, every iteration clipped, 20 iterations) at EP=4, TP=2 x EP=2
with sequence parallelism, PP=2 with 2 virtual stages each, DP=2 x EP=2 with the distributed
optimizer, CP=2 x EP=2 (chunks of 5 cross the split's 4-token pieces), and CP=2 with packed
documents; 8 ranks (TP=2 x EP=2 x PP=2, distributed optimizer) in the slow tier."""

import pytest

from tests.e2e.test_moe_layouts_e2e import DISTOPT, EVAL, SP, ep
from tests.e2e.test_moe_zero_e2e import ZERO3
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import (LAYOUT_ITERS, LAYOUT_LR, UNTIED,
                                    assert_close_history, cp_args, e2e_argv, layout_args,
                                    run_many)

MOE = ["--num-experts", "4", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "32",
       "--moe-layer-freq", "([0]*1+[1]*1)*2", "--moe-router-score-function", "sigmoid",
       "--moe-apply-probs-on-input", "--moe-shared-expert-intermediate-size", "32",
       "--moe-grouped-gemm"]
ATTENTION = ["--rotary-interleaved", "--qk-l2-norm", "--no-rope-freq", "2",
             "--attention-chunk-size", "5", "--attn-temperature-tuning",
             "--attn-temperature-floor-scale", "4", "--attn-temperature-scale", "0.5"]
# Packed documents (a MoE run takes no --calculate-per-token-loss, docs/moe.md)
DOCUMENTS = ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]


def _argv(data_prefix, cache, *extra):
    return e2e_argv(data_prefix, cache, "--train-iters", str(LAYOUT_ITERS), *LAYOUT_LR, *UNTIED,
                    *EVAL, *MOE, *extra)


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("llama4_layouts_cache1"))
    runs = [("plain", _argv(data_prefix, cache, *ATTENTION)),
            ("documents", _argv(data_prefix, cache, *ATTENTION, *DOCUMENTS)),
            ("no chunks", _argv(data_prefix, cache))]  # without the attention flags
    return run_distributed(1, run_many, runs, timeout=900)[0]


def test_the_attention_flags_change_the_run(single):
    """The runs below compare against a run the Llama 4 attention changes (the test has teeth)."""
    assert single["plain"]["lm loss"][1:] != single["no chunks"]["lm loss"][1:]
    assert single["plain"]["lm loss"][1:] != single["documents"]["lm loss"][1:]


def _four_ranks(single, runs):
    got = run_distributed(4, run_many, runs, timeout=1800)[-1]
    for name, _ in runs:
        want = single["documents" if "documents" in name else "plain"]
        assert_close_history(got[name], want, f"Llama 4 {name}")


@pytest.mark.slow  # 4 ranks x 3 runs x 20 iterations: 95 s and 11 min measured under load
def test_llama4_ep_tp_pp_match_one_process(single, data_prefix, tmp_path_factory):
    """EP=4, TP=2 x EP=2 (SP, expert-TP 1), PP=2 x EP=2 with 2 virtual stages each."""
    cache = str(tmp_path_factory.mktemp("llama4_layouts_cache4"))
    _four_ranks(single, [
        ("ep4", _argv(data_prefix, cache, *ATTENTION, *ep(4))),
        ("ep2 tp2", _argv(data_prefix, cache, *ATTENTION, *layout_args(2, 1), *SP, *ep(2))),
        ("pp2 virtual", _argv(data_prefix, cache, *ATTENTION, *layout_args(1, 2), *ep(2),
                              "--num-layers-per-virtual-pipeline-stage", "1"))])


@pytest.mark.slow  # 4 ranks x 3 runs x 20 iterations: 95 s and 11 min measured under load
def test_llama4_dp_cp_match_one_process(single, data_prefix, tmp_path_factory):
    """DP=2 x EP=2 with the distributed optimizer, CP=2 x EP=2, CP=2 with packed documents."""
    cache = str(tmp_path_factory.mktemp("llama4_layouts_cache4b"))
    _four_ranks(single, [
        ("ep2 dp2 distopt", _argv(data_prefix, cache, *ATTENTION, *ep(2), *DISTOPT)),
        ("ep2 cp2", _argv(data_prefix, cache, *ATTENTION, *cp_args(2), *ep(2))),
        ("cp2 documents", _argv(data_prefix, cache, *ATTENTION, *cp_args(2), *DOCUMENTS))])


@pytest.mark.slow
def test_llama4_tp2_ep2_pp2_matches_one_process(single, data_prefix, tmp_path_factory):
    """8 ranks: TP=2 (SP, expert-TP 1) x EP=2 x PP=2, DP=2, the distributed optimizer."""
    cache = str(tmp_path_factory.mktemp("llama4_layouts_cache8"))
    runs = [("tp2 ep2 pp2", _argv(data_prefix, cache, *ATTENTION, *layout_args(2, 2), *SP,
                                  *ep(2), *DISTOPT))]
    got = run_distributed(8, run_many, runs, timeout=1800)[-1]
    assert_close_history(got["tp2 ep2 pp2"], single["plain"], "Llama 4 TP=2 x EP=2 x PP=2")


def test_llama4_zero3_ep2_matches_one_process(single, data_prefix, tmp_path_factory):
    """ZeRO-3 (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params``) at
    DP=4 x EP=2: the dense parameters, gradients and optimizer state sharded over DP=4, the
    experts' over their expert-DP of 2; every layer gathered per forward and per backward."""
    cache = str(tmp_path_factory.mktemp("llama4_zero3_cache"))
    runs = [("ep2 zero3", _argv(data_prefix, cache, *ATTENTION, *ep(2), *ZERO3))]
    got = run_distributed(4, run_many, runs, timeout=1500)[-1]
    assert_close_history(got["ep2 zero3"], single["plain"], "Llama 4 ZeRO-3 DP=4 x EP=2")
