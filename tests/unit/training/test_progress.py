"""Progress lines within long iterations: the ETA arithmetic, the threshold, and the line in a
real run on rank 0 (megatron.training.logging.IterationProgress)."""

import contextlib
import io
import re

import pytest

from megatron.training import logging as training_logging
from megatron.training.logging import IterationProgress, eta_seconds
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import BASE

LINE = re.compile(r"iteration +(\d+)/ +(\d+) \| micro-batch +(\d+)/ +(\d+) \| elapsed time in "
                  r"iteration \(s\): ([0-9.]+) \| ETA of the run: (\d+):(\d\d):(\d\d) \|")


def test_eta_arithmetic():
    # 3 of 8 micro-batches in 6 s: 2 s each, 10 s left here; 90 iterations after this one.
    assert eta_seconds(iteration=11, train_iters=100, microbatch=3, num_microbatches=8,
                       iteration_elapsed_s=6.0) == 10.0 + 89 * 16.0
    # With finished iterations their mean time counts for the ones to come.
    assert eta_seconds(iteration=11, train_iters=100, microbatch=3, num_microbatches=8,
                       iteration_elapsed_s=6.0, mean_iteration_s=20.0) == 10.0 + 89 * 20.0
    assert eta_seconds(iteration=5, train_iters=5, microbatch=4, num_microbatches=4,
                       iteration_elapsed_s=3.0) == 0.0  # the last micro-batch of the last one
    with pytest.raises(ValueError):
        eta_seconds(iteration=1, train_iters=2, microbatch=0, num_microbatches=4,
                    iteration_elapsed_s=1.0)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lines_follow_the_threshold_and_count_chunks():
    clock, lines = _Clock(), []
    progress = IterationProgress(10, enabled=True, chunks=2, interval_s=30.0, clock=clock,
                                 write=lines.append)
    progress.start(1, 4)
    for step in range(8):  # 4 micro-batches x 2 virtual stages; 10 s between forward steps
        clock.now += 10.0
        progress.microbatch()
    # At 30 s (forward step 3: micro-batch 2) and 60 s (step 6: micro-batch 3).
    got = [LINE.search(line).groups() for line in lines]
    assert [(g[2], g[4]) for g in got] == [("2", "30.0"), ("3", "60.0")]
    # ETA at micro-batch 2 after 30 s: 2 x 15 s here, then 9 iterations of 60 s.
    h, m, s = map(int, got[0][5:])
    assert h * 3600 + m * 60 + s == 30 + 9 * 60
    progress.finish(80.0)
    progress.start(2, 4)
    clock.now += 40.0
    line = progress.microbatch()
    h, m, s = map(int, LINE.search(line).groups()[5:])
    assert h * 3600 + m * 60 + s == 3 * 40 + 8 * 80  # the mean of finished iterations counts


def test_no_lines_off_rank_0_in_short_iterations_or_outside_training():
    clock, lines = _Clock(), []
    for progress in (IterationProgress(5, enabled=False, interval_s=0.0, clock=clock,
                                       write=lines.append),
                     IterationProgress(5, enabled=True, interval_s=0.0, min_microbatches=2,
                                       clock=clock, write=lines.append)):
        progress.start(1, 1 if progress.enabled else 8)
        clock.now += 100.0
        progress.microbatch()
        progress.finish(100.0)
        progress.microbatch()  # evaluation's forward steps after the iteration: not counted
    assert lines == []


def _run_with_forced_threshold(argv):
    training_logging.PROGRESS_INTERVAL_S = 0.0  # a line at every micro-batch
    import pretrain_llama

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain_llama.main(argv)
    return out.getvalue()


def test_progress_lines_in_a_run(tmp_path):
    argv = BASE + ["--mock-data", "--train-iters", "2", "--micro-batch-size", "1",
                   "--global-batch-size", "4", "--eval-iters", "0", "--log-interval", "1",
                   "--lr-warmup-iters", "1"]
    text = run_distributed(1, _run_with_forced_threshold, argv, timeout=300)[0]
    got = [LINE.search(line).groups()[:4] for line in text.splitlines() if LINE.search(line)]
    assert got == [(str(it), "2", str(mb), "4") for it in (1, 2) for mb in (1, 2, 3, 4)]
    # The iteration line keeps Megatron's format after its micro-batches' progress lines.
    lines = text.splitlines()
    first_log = next(i for i, line in enumerate(lines) if "consumed samples:" in line)
    assert "micro-batch      4/     4" in lines[first_log - 1]
