"""ZeRO-2 / ZeRO-3 end to end through pretrain_llama.main() (``--use-megatron-fsdp
--data-parallel-sharding-strategy optim_grads | optim_grads_params``), 20 iterations, fp32,
dropout 0, clipping active, at the layout tests' learning rate (tests/helpers/pretrain.py
LAYOUT_LR: at 5e-3 clipped AdamW grows fp32 rounding to 1e-5 in the grad norm whatever the
strategy): at DP=4 (4 micro-batches per rank: ZeRO-2 reduce-scatters each, and a bug from the
third on, e.g. the third one's gradient added twice, passed every layout at 2), TP=2 x DP=2
(sequence parallel; 2 micro-batches per rank, global batch 4: each of its micro-batches costs
about 50 collectives, and the run at 4 per rank took twice as long), PP=2 x DP=2 (tied embedding
across stages, 1F1B over 2 micro-batches per rank: global batch 4, the fewest that reach its
steady state) and
(slow) CP=2 x DP=2 the losses, validation losses and grad norms equal plain data parallelism at
the same layout within rtol 1e-6 and the weights saved at the end (ZeRO-3: gathered for the save)
within 1e-7; ZeRO-2 (reduce-scattered per micro-batch) is within
the same bounds of the distributed optimizer, ZeRO-3 with --optimizer-cpu-offload bitwise ZeRO-3.
The slow test runs the 8-rank TP=2 x PP=2 x DP=2 layout with ZeRO-3, full recompute and the
interleaved schedule."""

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import LAYOUT_LR, UNTIED, e2e_argv, layout_args, run_many

ITERS = 20
SHORT = ["--train-iters", str(ITERS), "--eval-iters", "1", "--eval-interval", "10",
         "--global-batch-size", "8", "--micro-batch-size", "1", "--log-interval", "10",
         *LAYOUT_LR]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
STRATEGIES = {"plain": [], "zero1": FSDP + ["optim"], "zero2": FSDP + ["optim_grads"],
              "zero3": FSDP + ["optim_grads_params"],
              "zero3 offload": FSDP + ["optim_grads_params", "--optimizer-cpu-offload"]}
LAYOUTS = {"dp4": ((1, 1), UNTIED + ["--global-batch-size", "16"],
                   ("plain", "zero1", "zero2", "zero3", "zero3 offload")),
           "tp2": ((2, 1), UNTIED + ["--sequence-parallel", "--global-batch-size", "4"],
                   ("plain", "zero1", "zero2", "zero3")),
           "pp2": ((1, 2), ["--global-batch-size", "4"], ("plain", "zero1", "zero2", "zero3"))}


def _weights(folder, files):
    out = {}
    for f in files:
        state = torch.load(str(folder / f"iter_{ITERS:07d}" / f / "model_optim_rng.pt"),
                           weights_only=True)
        out.update({f"{f}/{k}": v for k, v in state["model"].items()})
    return out


@pytest.fixture(scope="module")
def runs(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("zero_cache"))
    save = tmp_path_factory.mktemp("zero_ckpt")
    argvs = [(f"{layout} {s}", e2e_argv(
        data_prefix, cache, *SHORT, *extra, *layout_args(*tp_pp), *STRATEGIES[s],
        "--save", str(save / f"{layout}_{s.replace(' ', '_')}")))
        for layout, (tp_pp, extra, strategies) in LAYOUTS.items() for s in strategies]
    # torch_dist: ZeRO-3 at TP=2 x DP=2 saves at iteration 10, read at DP=4 by ZeRO-3 and by plain
    # (the TP=2 layout's global batch of 4: one micro-batch per rank at DP=4)
    (tp_pp, extra, _), dist_dir = LAYOUTS["tp2"], str(save / "tp2_zero3_dist")
    argvs.append(("tp2 zero3 dist", e2e_argv(
        data_prefix, cache, *SHORT, *extra, *layout_args(*tp_pp), *STRATEGIES["zero3"],
        "--ckpt-format", "torch_dist", "--save", dist_dir, "--exit-interval", "10")))
    for s in ("zero3", "plain"):
        argvs.append((f"dp4 {s} resumed", e2e_argv(
            data_prefix, cache, *SHORT, *LAYOUTS["dp4"][1], "--global-batch-size", "4",
            *STRATEGIES[s], "--load", dist_dir)))
    return run_distributed(4, run_many, argvs, timeout=900)[3], save


def _assert_close(a, b, name, rtol):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    worst = ((a - b).abs() / b.abs()).max().item()
    assert a.shape == b.shape and worst <= rtol, f"{name}: relative difference {worst:.2e}"


def _assert_history(a, b, name, grad_norm_rtol):
    assert len(a["lm loss"]) == ITERS, name
    _assert_close(a["lm loss"], b["lm loss"], f"{name}: lm loss", 1e-6)
    _assert_close([v for _, v in a["valid"]], [v for _, v in b["valid"]],
                  f"{name}: validation loss", 1e-6)
    _assert_close(a["grad norm"], b["grad norm"], f"{name}: grad norm", grad_norm_rtol)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_strategies_equal_plain_data_parallel(runs, layout):
    """Losses, validation losses and grad norms within rtol 1e-6 of plain DP, the saved weights
    within 1e-7 (gloo's all-reduce and reduce-scatter sum the ranks' fp32 gradients in other
    orders, and ZeRO-3's units change which rank reduces which element: rounding, which the
    layout tests' learning rate keeps from growing). ZeRO-2 keeps ZeRO-1's buckets but
    reduce-scatters them in every micro-batch (sums over ranks per micro-batch, then over the
    micro-batches in the fp32 shard; ZeRO-1 sums micro-batches first): against ZeRO-1 the
    same bounds hold (measured over the 20 iterations with 2 micro-batches per rank: at most
    4.9e-8 relative in the loss, 3.7e-8 in the grad norm and 1.2e-7 absolute, one fp32 ulp of
    the norm weights near 1, in the saved weights)."""
    out, save = runs
    files = {"dp4": ["mp_rank_00"], "tp2": ["mp_rank_00", "mp_rank_01"],
             "pp2": ["mp_rank_00_000", "mp_rank_00_001"], "cp2": ["mp_rank_00"]}[layout]
    plain = _weights(save / f"{layout}_plain", files)
    zero1 = _weights(save / f"{layout}_zero1", files)
    for strategy in LAYOUTS[layout][2][1:]:
        name = f"{layout} {strategy}"
        _assert_history(out[name], out[f"{layout} plain"], name, grad_norm_rtol=1e-6)
        weights = _weights(save / f"{layout}_{strategy.replace(' ', '_')}", files)
        assert weights.keys() == plain.keys()
        for k, v in weights.items():
            torch.testing.assert_close(v, plain[k], rtol=1e-6, atol=1e-7, msg=f"{name} {k}")
        if strategy == "zero2":
            # reduce-scattered per micro-batch (4 or 2 here): other fp32 sums, see the docstring
            _assert_history(out[name], out[f"{layout} zero1"], name, grad_norm_rtol=1e-6)
            for k, v in weights.items():
                torch.testing.assert_close(v, zero1[k], rtol=1e-6, atol=1e-7, msg=f"{name} {k}")
        if strategy == "zero3":
            _assert_history(out[name], out[f"{layout} zero1"], name, grad_norm_rtol=1e-6)
        if strategy == "zero3 offload":  # the step on host copies: the same arithmetic
            for key in ("lm loss", "grad norm", "valid"):
                assert out[name][key] == out[f"{layout} zero3"][key], (name, key)


def test_torch_dist_checkpoint_reshards_across_strategies_and_dp_sizes(runs):
    """Saved by ZeRO-3 at TP=2 x DP=2 (iteration 10), resumed at TP=1 x DP=4 by ZeRO-3 and by
    plain DP: iterations 11..20 equal the uninterrupted TP=2 x DP=2 runs of that strategy."""
    out, _ = runs
    assert out["tp2 zero3 dist"]["lm loss"] == out["tp2 zero3"]["lm loss"][:10]
    for s in ("zero3", "plain"):
        resumed, whole = out[f"dp4 {s} resumed"], out[f"tp2 {s}"]
        assert resumed["iteration"] == list(range(11, ITERS + 1))
        _assert_close(resumed["lm loss"], whole["lm loss"][10:], f"{s} resumed: lm loss", 1e-6)
        _assert_close(resumed["grad norm"], whole["grad norm"][10:], f"{s} resumed: grad norm",
                      1e-6)


@pytest.mark.slow
def test_zero3_tp2_pp2_dp2_interleaved_recompute(data_prefix, tmp_path):
    """8 ranks, TP=2 x PP=2 x DP=2, two virtual stages per pipeline rank, full recompute, sequence
    parallel, tied embedding: ZeRO-3 against plain DP at the same layout."""
    extra = [*layout_args(2, 2), "--num-layers-per-virtual-pipeline-stage", "1",
             "--sequence-parallel", "--recompute-granularity", "full",
             "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    argvs = [(s, e2e_argv(data_prefix, str(tmp_path), *SHORT, *extra, *STRATEGIES[s]))
             for s in ("plain", "zero3")]
    out = run_distributed(8, run_many, argvs, timeout=1200)[7]
    _assert_history(out["zero3"], out["plain"], "TP2 PP2 DP2 zero3", grad_norm_rtol=1e-6)


@pytest.mark.slow
def test_zero3_cp2_dp2(data_prefix, tmp_path):
    """Context parallelism: ZeRO-3 shards over DP x CP = 4 ranks; against plain DP at CP=2 x DP=2
    and the distributed optimizer there."""
    extra = UNTIED + ["--context-parallel-size", "2"]
    argvs = [(s, e2e_argv(data_prefix, str(tmp_path), *SHORT, *extra, *STRATEGIES[s]))
             for s in ("plain", "zero1", "zero3")]
    out = run_distributed(4, run_many, argvs, timeout=1200)[3]
    _assert_history(out["zero3"], out["plain"], "CP2 DP2 zero3", grad_norm_rtol=1e-6)
    _assert_history(out["zero3"], out["zero1"], "CP2 DP2 zero3 vs zero1", grad_norm_rtol=1e-6)
