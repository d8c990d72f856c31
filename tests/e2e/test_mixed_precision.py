"""fp16 loss scaling and non-finite iterations, end to end through ``pretrain_llama.main``.

An overflow (the loss multiplied by 1e8: fp16 gradients overflow, the loss itself stays finite) or
a NaN is injected into the first micro-batch of chosen iterations by wrapping
``pretrain_llama.forward_step``; the wrapper also snapshots the parameters at the start of every
iteration, so a skipped iteration shows as parameters left exactly unchanged.
"""

import contextlib
import io
import math
import os

import numpy as np
import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import BASE

MBS, GBS = 2, 4  # two micro-batches per iteration at DP=1


def _argv(prefix, cache, iters, *extra):
    argv = [a for a in BASE]
    for flag, value in (("--train-iters", str(iters)), ("--global-batch-size", str(GBS)),
                        ("--eval-iters", "0"), ("--log-interval", "1"), ("--lr-warmup-iters", "4" if iters > 5 else "2"),
                        ("--eval-interval", "1000")):
        argv[argv.index(flag) + 1] = value
    return argv + ["--data-path", prefix, "--data-cache-path", cache] + list(extra)


def _wrap_forward_step(inject, num_microbatches, snapshots):
    """``pretrain_llama.forward_step`` that injects ``inject[iteration]`` (``"overflow"``,
    ``"nan"``: NaN loss, ``"nan_report"``: NaN only in the reported loss, gradients finite) into
    the iteration's first micro-batch and snapshots the parameters there."""
    import torch

    import pretrain_llama

    real, calls = pretrain_llama.forward_step, [0]

    def forward_step(args, eod, data_iterator, model, *rest, **kwargs):
        iteration, first = calls[0] // num_microbatches + 1, calls[0] % num_microbatches == 0
        calls[0] += 1
        if first:
            snapshots[iteration] = [p.detach().float().clone() for p in model.parameters()]
        output, loss_func = real(args, eod, data_iterator, model, *rest, **kwargs)
        kind = inject.get(iteration) if first else None
        if kind is None:
            return output, loss_func

        def bad_loss(output_tensor):
            loss, num_tokens, report = loss_func(output_tensor)
            nan = torch.tensor(float("nan"))
            if kind == "overflow":
                return loss * 1e8, num_tokens, report
            if kind == "nan":
                return loss * nan, num_tokens, {"lm loss": (report["lm loss"][0] * nan,
                                                            report["lm loss"][1])}
            return loss, num_tokens, {"lm loss": (nan, report["lm loss"][1])}
        return output, bad_loss

    pretrain_llama.forward_step = forward_step


def _run(runs):
    """Each ``(argv, inject, num_microbatches)``: the history and, for iterations k = 2, 3, ...,
    whether the parameters changed between the starts of iterations k and k+1 (iteration 1 runs
    at the warmup's learning rate 0)."""
    import torch
    import torch.distributed as dist

    import pretrain_llama
    from megatron.training.train import NonFiniteTrainingError

    real, out = pretrain_llama.forward_step, []
    for argv, inject, m in runs:
        snapshots, log = {}, io.StringIO()
        _wrap_forward_step(inject, m, snapshots)
        try:
            with contextlib.redirect_stdout(log):
                history, error = pretrain_llama.main(argv), None
        except NonFiniteTrainingError as err:
            history, error = None, str(err)
        finally:
            pretrain_llama.forward_step = real
        changed = [any(not torch.equal(a, b) for a, b in zip(snapshots[k], snapshots[k + 1]))
                   for k in sorted(snapshots) if k >= 2 and k + 1 in snapshots]
        if history is not None:
            history = {k: v for k, v in history.items() if k != "final valid"}
        out.append({"history": history, "changed": changed, "error": error,
                    "log": log.getvalue()})
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("mp_cache"))
    save = str(tmp_path_factory.mktemp("mp_save"))
    fp16 = ["--fp16", "--initial-loss-scale", "65536"]
    runs = [
        # hysteresis 1, window 3: the overflow at 3 halves the scale; 3 clean iterations regrow it.
        (_argv(data_prefix, cache, 8, *fp16, "--hysteresis", "1", "--loss-scale-window", "3"),
         {3: "overflow"}, 2),
        # hysteresis 2, window 4: the overflow at 3 is tolerated, the one at 5 halves.
        (_argv(data_prefix, cache, 9, *fp16, "--hysteresis", "2", "--loss-scale-window", "4"),
         {3: "overflow", 5: "overflow"}, 2),
        (_argv(data_prefix, cache, 4, "--fp16", "--loss-scale", "1024"), {2: "overflow"}, 2),
        (_argv(data_prefix, cache, 6, "--bf16"), {3: "nan"}, 2),
        # fp32, NaN at 4, 5, 6 with a checkpoint every 2 iterations: stops at 6, before saving.
        (_argv(data_prefix, cache, 10, "--save", save, "--save-interval", "2"),
         {4: "nan", 5: "nan", 6: "nan"}, 2),
        # fp16 overflowing from iteration 3 on: the scale backs off 4 -> 2 -> 1 (routine), then
        # each overflow at --min-loss-scale 1 is non-finite: stops after the third, at 7.
        (_argv(data_prefix, cache, 12, "--fp16", "--initial-loss-scale", "4", "--min-loss-scale",
               "1", "--hysteresis", "1"), {k: "overflow" for k in range(3, 13)}, 2),
        # One NaN at 3, a save every 2 iterations keeping the last one: iteration 2's
        # checkpoint, the last before the NaN, is kept beside the newest.
        (_argv(data_prefix, cache, 8, "--save", str(tmp_path_factory.mktemp("keep")),
               "--save-interval", "2", "--keep-last-checkpoints", "1"), {3: "nan"}, 2),
        # A NaN at the last iteration: the end-of-training save is skipped, saying so.
        (_argv(data_prefix, cache, 4, "--save", str(tmp_path_factory.mktemp("end"))),
         {4: "nan"}, 2),
        # The same two rules for --ckpt-format torch_dist with --async-save: iteration 2's save,
        # handed to the background writer before the NaN at 3, is published and kept.
        (_argv(data_prefix, cache, 8, "--save", str(tmp_path_factory.mktemp("keep_dist")),
               "--save-interval", "2", "--keep-last-checkpoints", "1", "--ckpt-format",
               "torch_dist", "--async-save"), {3: "nan"}, 2),
        (_argv(data_prefix, cache, 4, "--save", str(tmp_path_factory.mktemp("end_dist")),
               "--ckpt-format", "torch_dist"), {4: "nan"}, 2),
    ]
    return run_distributed(1, _run, runs, timeout=600)[0], save, [r[0] for r in runs]


def test_fp16_overflow_is_skipped_and_hysteresis_1_halves_then_regrows(single):
    r = single[0][0]
    h = r["history"]
    assert h["skipped"] == [0, 0, 1, 0, 0, 0, 0, 0] and h["nan"] == [0] * 8
    assert h["loss scale"] == [65536, 65536, 32768, 32768, 32768, 65536, 65536, 65536]
    assert r["changed"] == [True, False, True, True, True, True]
    # The lr schedule does not advance on a skipped iteration (warmup is still running).
    lr = h["learning rate"]
    assert lr[2] == lr[1] and lr[3] > lr[2]
    assert all(math.isfinite(v) for v in h["lm loss"]) and h["grad norm"][2] is None


def test_fp16_hysteresis_2_halves_on_the_second_overflow(single):
    h = single[0][1]["history"]
    s = 65536
    assert h["skipped"] == [0, 0, 1, 0, 1, 0, 0, 0, 0]
    assert h["loss scale"] == [s, s, s, s, s / 2, s / 2, s / 2, s / 2, s]
    assert single[0][1]["changed"] == [True, False, True, False, True, True, True]


def test_constant_loss_scale_skips_without_changing(single):
    h = single[0][2]["history"]
    assert h["skipped"] == [0, 1, 0, 0] and h["loss scale"] == [1024] * 4
    assert single[0][2]["changed"] == [False, True]


def test_bf16_nan_is_skipped_and_counted(single):
    r = single[0][3]
    h = r["history"]
    assert h["nan"] == [0, 0, 1, 0, 0, 0] and h["skipped"] == [0, 0, 1, 0, 0, 0]
    assert r["changed"] == [True, False, True, True]
    assert math.isnan(h["lm loss"][2]) and all(math.isfinite(v) for i, v in
                                               enumerate(h["lm loss"]) if i != 2)


def test_consecutive_nans_stop_training_and_keep_the_checkpoint(single):
    """The save at 4 falls inside the streak: skipped; the stop names the one of iteration 2."""
    results, save, _ = single
    r = results[4]
    assert r["history"] is None and "training stopped at iteration 6" in r["error"]
    assert "iterations 4 to 6" in r["error"] and "--max-consecutive-nan-iterations 3" in r["error"]
    assert (f"the last good checkpoint, iteration 2 in {save}/iter_0000002, is left as it was: "
            f"resume from it with --load {save}") in r["error"]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert r["changed"] == [True, True, False, False]
    assert ("not saving the checkpoint of iteration 4 (--save-interval): iteration 4 had inf/NaN "
            "loss or gradients") in r["log"]


def test_fp16_overflow_at_the_lowest_loss_scale_stops_the_run(single):
    r = single[0][5]
    h_error = r["error"]
    assert r["history"] is None, "exit 0 after skipping every iteration"
    assert ("training stopped at iteration 7: iterations 5 to 7 overflowed in fp16 (inf/NaN loss "
            "or gradients) at the lowest loss scale (--min-loss-scale 1) (3 in a row, "
            "--max-consecutive-nan-iterations 3)") in h_error, h_error
    assert "no checkpoint of this run was written" in h_error and "use --bf16" in h_error


def _saved(argv):
    return argv[argv.index("--save") + 1]


def test_keep_last_keeps_the_last_checkpoint_before_a_nan(single):
    r, argv = single[0][6], single[2][6]
    assert r["error"] is None and r["history"]["nan"] == [0, 0, 1, 0, 0, 0, 0, 0]
    # Without the rule --keep-last-checkpoints 1 leaves iter_0000008 alone.
    assert sorted(os.listdir(_saved(argv))) == ["iter_0000002", "iter_0000008",
                                                "latest_checkpointed_iteration.txt"]


def test_a_save_at_a_nan_iteration_is_skipped_saying_so(single):
    r, argv = single[0][7], single[2][7]
    assert r["error"] is None and r["history"]["nan"] == [0, 0, 0, 1]
    assert ("not saving the checkpoint of iteration 4 (the end of training): iteration 4 had "
            "inf/NaN loss or gradients; no checkpoint of this run was written") in r["log"]
    assert os.listdir(_saved(argv)) == []


def test_pipeline_ranks_skip_alike(data_prefix, tmp_path):
    """PP=2: fp16 overflow, and a NaN only in the last stage's reported loss (finite gradients):
    both stages skip the same iterations and keep their parameters."""
    cache = str(tmp_path / "cache")
    pp = ["--pipeline-model-parallel-size", "2"]
    runs = [(_argv(data_prefix, cache, 4, *pp, "--fp16", "--initial-loss-scale", "1024",
                   "--hysteresis", "1"), {2: "overflow"}, 2),
            (_argv(data_prefix, cache, 4, *pp, "--bf16"), {3: "nan_report"}, 2)]
    first, last = run_distributed(2, _run, runs, timeout=600)
    for rank in (first, last):
        assert rank[0]["history"]["skipped"] == [0, 1, 0, 0]
        assert rank[0]["history"]["loss scale"] == [1024, 512, 512, 512]
        assert rank[0]["changed"] == [False, True]
        assert rank[1]["history"]["skipped"] == [0, 0, 1, 0]
        assert rank[1]["changed"] == [True, False]
    assert last[1]["history"]["nan"] == [0, 0, 1, 0]
    assert np.isnan(last[1]["history"]["lm loss"][2])


@pytest.mark.parametrize("case", [8, 9], ids=["keep-last", "end of training"])
def test_the_rules_hold_for_torch_dist_and_async_save(single, case):
    r, argv = single[0][case], single[2][case]
    assert r["error"] is None
    if case == 8:
        assert r["history"]["nan"] == [0, 0, 1, 0, 0, 0, 0, 0]
        assert sorted(os.listdir(_saved(argv))) == ["iter_0000002", "iter_0000008",
                                                    "latest_checkpointed_iteration.txt"]
        assert "in the background" in r["log"]
    else:
        assert "not saving the checkpoint of iteration 4 (the end of training)" in r["log"]
        assert os.listdir(_saved(argv)) == []
