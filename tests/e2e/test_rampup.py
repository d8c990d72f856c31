"""Batch-size ramp-up end to end through ``pretrain_llama.main`` (DP=2), and its flag checks.

``--rampup-batch-size 4 4 40`` with ``--global-batch-size 12``: two increments, one every
40 / 2 = 20 consumed samples (Megatron-LM's ``RampupBatchsizeNumMicroBatches``). Megatron's
``update_train_iters`` for ``--train-samples 100``: ramp-up iterations while at most 40 samples are
consumed (batches 4 4 4 4 4 8 8 8, 44 samples), then (100 - 44) // 12 = 4 full batches.
"""

import contextlib
import io
import math
import re

import pytest

from tests.helpers.arguments import base_argv, check
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import BASE

BATCHES = [4, 4, 4, 4, 4, 8, 8, 8, 12, 12, 12, 12]
RAMPUP = ["--rampup-batch-size", "4", "4", "40", "--global-batch-size", "12",
          "--train-samples", "100", "--lr-warmup-samples", "16", "--lr-decay-samples", "80"]


def _argv(prefix, cache):
    argv = list(BASE)
    for flag in ("--train-iters", "--lr-warmup-iters", "--global-batch-size"):
        i = argv.index(flag)
        del argv[i:i + 2]
    argv[argv.index("--log-interval") + 1] = "1"
    argv[argv.index("--eval-interval") + 1] = "4"
    return argv + RAMPUP + ["--data-path", prefix, "--data-cache-path", cache]


def _train(argv):
    """Run main; return this rank's history, its printed lines and its forward-step count."""
    import pretrain_llama

    real, calls = pretrain_llama.forward_step, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    pretrain_llama.forward_step = counting
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            history = pretrain_llama.main(argv)
    finally:
        pretrain_llama.forward_step = real
    history.pop("final valid", None)
    return history, out.getvalue(), calls[0]


def test_rampup_follows_megatron_arithmetic_end_to_end(data_prefix, tmp_path):
    results = run_distributed(2, _train, _argv(data_prefix, str(tmp_path)), timeout=600)
    history, log, _ = results[-1]
    consumed = [sum(BATCHES[:i + 1]) for i in range(len(BATCHES))]
    assert history["iteration"] == list(range(1, 13))
    assert history["global batch size"] == BATCHES
    assert history["consumed samples"] == consumed
    logged = [(int(a), int(b), int(c)) for a, b, c in re.findall(
        r"iteration\s+(\d+)/\s+12 \| consumed samples:\s+(\d+) \|.*? global batch size:\s+(\d+)",
        log)]
    assert logged == [(i + 1, consumed[i], BATCHES[i]) for i in range(12)]
    # Each DP rank runs batch / (micro-batch 2 x DP 2) micro-batches per iteration (plus the
    # evaluations at iterations 4, 8, 12 and the end: 4 x 2 iterations of 12 / 4 micro-batches).
    for _, _, calls in results:
        assert calls == sum(BATCHES) // 4 + 4 * 2 * 3
    # The lr schedule counts samples: warmup over 16, cosine decay to 80 (lr 5e-3 -> 5e-4).
    for lr, done in zip(history["learning rate"], consumed):
        if done <= 16:
            expected = 5e-3 * done / 16
        else:
            ratio = min((done - 16) / (80 - 16), 1.0)
            expected = 5e-4 + (5e-3 - 5e-4) * 0.5 * (math.cos(math.pi * ratio) + 1.0)
        assert lr == pytest.approx(expected, rel=1e-9), (done, lr, expected)
    assert all(math.isfinite(v) for v in history["lm loss"])


@pytest.mark.parametrize("extra, message", [
    (["--rampup-batch-size", "4", "4", "40", "--train-iters", "10"],
     r"--rampup-batch-size \(4 4 40\) needs sample-based training .*--train-samples"),
    (["--rampup-batch-size", "2", "4", "40", "--train-samples", "100"],
     r"START and INCR must be multiples of --micro-batch-size \(2\) x data-parallel size \(2\)"),
    (["--rampup-batch-size", "4", "8", "40", "--train-samples", "100"],
     r"--global-batch-size \(8\) minus the ramp-up start \(4\) must be a non-negative multiple"),
    (["--rampup-batch-size", "4", "x", "40", "--train-samples", "100"], r"three integers"),
])
def test_rampup_flags_are_checked(files, extra, message):
    argv = base_argv(files)
    i = argv.index("--train-iters")
    del argv[i:i + 2]
    argv[argv.index("--global-batch-size") + 1] = "8"
    with pytest.raises(ValueError, match=message):
        check(argv + extra, world_size=2)
