"""Console and TensorBoard output of the training loop, in Megatron-LM's formats.

The iteration line follows Megatron-LM's ``training_log``; the validation block its
``evaluate_and_print_results``; TensorBoard scalars keep Megatron's tags (``learning-rate``,
``lm loss``, ``grad-norm``, ``batch-size``, ``iteration-time``, ``lm loss validation``,
``lm loss validation ppl``, each also ``... vs samples``) and are written by the last rank, as in
Megatron.
"""

from __future__ import annotations

import math
import os
import time
from datetime import datetime, timedelta
from typing import Callable

import torch
import torch.distributed as dist


def is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    if is_last_rank():
        print(message, flush=True)


def format_iteration_line(*, iteration: int, train_iters: int, consumed_samples: int,
                          elapsed_ms: float, tokens_per_s: float, learning_rate: float,
                          global_batch_size: int, losses: dict, loss_scale: float,
                          grad_norm: float | None, skipped: int, nans: int,
                          tflops_per_device: float, mfu: float | None = None,
                          device_type: str = "cuda") -> str:
    """Megatron-LM's iteration log line, plus ``tokens/s`` (total over all ranks) and, when a
    peak is known (``--peak-tflops`` / ``--measure-peak``), ``MFU`` (a fraction, printed in %).

    The throughput is Megatron's ``throughput per GPU (TFLOP/s/GPU)`` on CUDA and
    ``throughput per device (TFLOP/s/device)`` on any other ``device_type`` (a CPU process is
    no GPU)."""
    s = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    s += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    s += " consumed samples: {:12d} |".format(consumed_samples)
    s += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms)
    s += " tokens/s: {:.1f} |".format(tokens_per_s)
    # Megatron prints one decimal; CPU throughputs are far below 0.1 TFLOP/s, so show three.
    unit = "GPU" if device_type == "cuda" else "device"
    s += " throughput per {u} (TFLOP/s/{u}): {:.{p}f} |".format(
        tflops_per_device, u=unit, p=1 if tflops_per_device >= 1 else 3)
    if mfu is not None:
        s += " MFU: {:.1f}% |".format(100.0 * mfu)
    s += " learning rate: {:.6E} |".format(learning_rate)
    s += " global batch size: {:5d} |".format(global_batch_size)
    for key, value in losses.items():
        s += " {}: {:.6E} |".format(key, value)
    s += " loss scale: {:.1f} |".format(loss_scale)
    if grad_norm is not None:
        s += " grad norm: {:.3f} |".format(grad_norm)
    s += " number of skipped iterations: {:3d} |".format(skipped)
    s += " number of nan iterations: {:3d} |".format(nans)
    return s


# A progress line within an iteration: at most one per PROGRESS_INTERVAL_S seconds, and only in
# iterations of at least PROGRESS_MIN_MICROBATCHES micro-batches (a short iteration is covered by
# the iteration lines).
PROGRESS_INTERVAL_S = 30.0
PROGRESS_MIN_MICROBATCHES = 2


def eta_seconds(*, iteration: int, train_iters: int, microbatch: int, num_microbatches: int,
                iteration_elapsed_s: float, mean_iteration_s: float | None = None) -> float:
    """Seconds left in the run while iteration ``iteration`` (1-based) has started
    ``microbatch`` of its ``num_microbatches`` micro-batches in ``iteration_elapsed_s`` seconds:
    the rest of this iteration at its pace so far, plus ``train_iters - iteration`` iterations of
    ``mean_iteration_s`` (the mean of this run's finished iterations), or of this iteration's
    projected time where none has finished yet.

    Raises:
        ValueError: ``microbatch`` outside ``[1, num_microbatches]``.
    """
    if not 1 <= microbatch <= num_microbatches:
        raise ValueError(f"micro-batch {microbatch} of {num_microbatches}")
    per_microbatch = iteration_elapsed_s / microbatch
    this_iteration = (num_microbatches - microbatch) * per_microbatch
    per_iteration = mean_iteration_s if mean_iteration_s else per_microbatch * num_microbatches
    return this_iteration + max(0, train_iters - iteration) * per_iteration


def format_progress_line(*, iteration: int, train_iters: int, microbatch: int,
                         num_microbatches: int, iteration_elapsed_s: float, eta_s: float) -> str:
    """The line between iteration lines: Megatron's date and ``iteration N/T`` prefix, the
    micro-batch reached, the time in the iteration so far and the run's estimated time left."""
    s = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    s += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    s += " micro-batch {:6d}/{:6d} |".format(microbatch, num_microbatches)
    s += " elapsed time in iteration (s): {:.1f} |".format(iteration_elapsed_s)
    s += " ETA of the run: {} |".format(timedelta(seconds=round(eta_s)))
    return s


class IterationProgress:
    """Progress lines within long iterations (rank 0 only): :meth:`wrap` counts the forward
    steps the schedule calls, and one line (:func:`format_progress_line`) is printed when
    ``interval_s`` seconds have passed since the iteration started or the last such line.

    Reads only the host clock: on CUDA the count is of micro-batches the host has queued, and
    nothing waits for the device (no host synchronisation is added).

    Args:
        train_iters: the run's last iteration.
        enabled: print at all (rank 0).
        chunks: model chunks per rank (virtual pipeline stages): forward steps per micro-batch.
        interval_s, min_microbatches: see ``PROGRESS_INTERVAL_S``, ``PROGRESS_MIN_MICROBATCHES``
            (read when None, so they can be changed on the module).
        clock: seconds (``time.perf_counter``); write: where lines go (``print``).
    """

    def __init__(self, train_iters: int, *, enabled: bool, chunks: int = 1,
                 interval_s: float | None = None, min_microbatches: int | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 write: Callable[[str], None] | None = None):
        self.train_iters, self.enabled, self.chunks = train_iters, enabled, max(1, chunks)
        self.interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
        self.min_microbatches = (PROGRESS_MIN_MICROBATCHES if min_microbatches is None
                                 else min_microbatches)
        self.clock = clock
        self.write = write or (lambda line: print(line, flush=True))
        self.active = False
        self.finished_s, self.finished = 0.0, 0  # this run's finished iterations

    def start(self, iteration: int, num_microbatches: int) -> None:
        """Iteration ``iteration`` (1-based) of ``num_microbatches`` micro-batches begins."""
        self.iteration, self.num_microbatches = iteration, num_microbatches
        self.calls = 0
        self.started = self.last_line = self.clock()
        self.active = self.enabled and num_microbatches >= self.min_microbatches

    def finish(self, elapsed_s: float) -> None:
        """The iteration took ``elapsed_s`` seconds (the iteration line's measurement)."""
        self.active = False
        self.finished_s += elapsed_s
        self.finished += 1

    def microbatch(self) -> str | None:
        """Count one forward step; returns the line printed, if any."""
        if not self.active:
            return None
        self.calls += 1
        now = self.clock()
        if now - self.last_line < self.interval_s:
            return None
        self.last_line = now
        reached = min(self.num_microbatches, -(-self.calls // self.chunks))
        elapsed = now - self.started
        mean = self.finished_s / self.finished if self.finished else None
        eta = eta_seconds(iteration=self.iteration, train_iters=self.train_iters,
                          microbatch=reached, num_microbatches=self.num_microbatches,
                          iteration_elapsed_s=elapsed, mean_iteration_s=mean)
        line = format_progress_line(iteration=self.iteration, train_iters=self.train_iters,
                                    microbatch=reached, num_microbatches=self.num_microbatches,
                                    iteration_elapsed_s=elapsed, eta_s=eta)
        self.write(line)
        return line

    def wrap(self, forward_step_func):
        """``forward_step_func`` that counts each call first (same signature)."""
        def forward_step(data_iterator, model):
            self.microbatch()
            return forward_step_func(data_iterator, model)
        return forward_step


def format_validation_block(prefix: str, losses: dict) -> str:
    """Megatron-LM's validation report: a dashed frame around ``KEY value | KEY PPL``."""
    s = " validation loss at {} | ".format(prefix)
    for key, value in losses.items():
        s += "{} value: {:.6E} | ".format(key, value)
        s += "{} PPL: {:.6E} | ".format(key, math.exp(min(20.0, value)))
    line = "-" * (len(s) + 1)
    return f"{line}\n{s}\n{line}"


def anonymous_memory_mb() -> float | None:
    """Anonymous resident memory of this process in MB (``RssAnon`` of /proc/self/status): the
    heap and tensors, without mapped files such as an mmap'd dataset. None where unavailable."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def memory_report(name: str, device: torch.device) -> str:
    """Megatron-LM's ``report_memory`` line; on CPU the process's anonymous memory."""
    rank = dist.get_rank()
    if device.type == "cuda":
        mb = 1024.0 * 1024.0
        return (f"[Rank {rank}] {name} memory (MB) | allocated: {torch.cuda.memory_allocated() / mb}"
                f" | max allocated: {torch.cuda.max_memory_allocated() / mb}"
                f" | reserved: {torch.cuda.memory_reserved() / mb}"
                f" | max reserved: {torch.cuda.max_memory_reserved() / mb}")
    anon = anonymous_memory_mb()
    return f"[Rank {rank}] {name} memory (MB) | RssAnon: {anon if anon is None else round(anon, 1)}"


class TensorBoardLogger:
    """Megatron's TensorBoard scalars, written by the last rank only (a no-op elsewhere or without
    ``--tensorboard-dir``); the same scalars go to W&B when a ``wandb_writer`` is given
    (:mod:`megatron.training.wandb_writer`; Megatron-LM logs them there without the
    ``vs samples`` copies)."""

    def __init__(self, log_dir: str | None, queue_size: int = 1000, wandb_writer=None):
        self.writer, self.log_dir = None, log_dir
        self.wandb = wandb_writer
        if log_dir and is_last_rank():
            from torch.utils.tensorboard import SummaryWriter

            try:
                os.makedirs(log_dir, exist_ok=True)
                self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)
            except OSError as exc:
                self._drop(exc)

    def _drop(self, exc: BaseException) -> None:
        """A full disk (or any failed write) under ``--tensorboard-dir`` never stops training:
        one warning, and the events are dropped from here on."""
        print(f" WARNING: --tensorboard-dir {self.log_dir}: {exc}; TensorBoard events are dropped "
              "from here on (training goes on)", flush=True)
        self.writer = None

    def _guarded(self, call) -> None:
        if self.writer is not None:
            try:
                call(self.writer)
            except OSError as exc:  # tensorboard re-raises its writer thread's error here
                self._drop(exc)

    def _write(self, scalars: dict, iteration: int, samples: int) -> None:
        def add(writer):
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, iteration)
                if tag != "iteration-time":  # Megatron writes it against iterations only
                    writer.add_scalar(f"{tag} vs samples", value, samples)

        self._guarded(add)
        if self.wandb is not None and scalars:
            self.wandb.log(scalars, iteration)

    def training(self, iteration: int, samples: int, *, learning_rate: float, batch_size: int,
                 losses: dict, grad_norm: float | None, iteration_time_s: float,
                 loss_scale: float) -> None:
        if self.writer is None and self.wandb is None:
            return
        scalars = {"learning-rate": learning_rate, "batch-size": batch_size, **losses,
                   "loss-scale": loss_scale}
        if grad_norm is not None:
            scalars["grad-norm"] = grad_norm
        scalars["iteration-time"] = iteration_time_s
        self._write(scalars, iteration, samples)

    def validation(self, iteration: int, samples: int, losses: dict) -> None:
        if self.writer is None and self.wandb is None:
            return
        scalars = {}
        for key, value in losses.items():
            scalars[f"{key} validation"] = value
            scalars[f"{key} validation ppl"] = math.exp(min(20.0, value))
        self._write(scalars, iteration, samples)
        self._guarded(lambda writer: writer.flush())

    def close(self) -> None:
        self._guarded(lambda writer: writer.close())
        if self.wandb is not None:
            self.wandb.close()
