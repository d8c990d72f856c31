"""Stopping a run cleanly and turning hangs into errors.

* :class:`ExitConditions`: ``--exit-signal-handler`` (SIGTERM, as Megatron-LM's
  ``DistributedSignalHandler``) and ``--exit-duration-in-mins`` (fractions of a minute allowed).
  Each rank looks at its own signal flag and clock; one all-reduce (MAX) per iteration makes every
  rank agree, so all of them finish the same iteration, save and exit together even when the
  signal reached one rank only.
* :func:`collective_guard`: a collective that does not complete within
  ``--distributed-timeout-minutes`` raises in gloo with a bare "Timed out waiting ... ms for recv
  operation"; the guard re-raises it as :class:`CollectiveTimeoutError` naming the rank, the
  phase of training (the operation) and the timeout. Under NCCL the watchdog aborts the process
  after the same timeout instead.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import torch
import torch.distributed as dist


class CollectiveTimeoutError(RuntimeError):
    """A collective or point-to-point operation did not complete within the timeout."""


class _EarlySignal:
    """The flag-only handler installed at the program's start (:func:`catch_signal_early`)."""

    def __init__(self):
        self.received = False
        self.previous = None

    def __call__(self, signum, frame):
        self.received = True


def catch_signal_early(enabled: bool, sig=signal.SIGTERM) -> None:
    """``--exit-signal-handler`` from the start of the run, as Megatron-LM installs its handler
    at initialisation: a SIGTERM during start-up (process groups, the model build, a long
    ``--load``) is remembered, and :class:`ExitConditions` acts on it after the first
    iteration (every rank saves and exits 0). Before, it killed the ranks (status -15). Off
    the main thread nothing is installed."""
    if enabled and threading.current_thread() is threading.main_thread():
        handler = _EarlySignal()
        handler.previous = signal.signal(sig, handler)


def release_signal_early(sig=signal.SIGTERM) -> None:
    """Put back the handler :func:`catch_signal_early` replaced, if it is still installed (a run
    that ended before its training loop took the signal over)."""
    current = signal.getsignal(sig)
    if isinstance(current, _EarlySignal):
        signal.signal(sig, current.previous)


class ExitConditions:
    """The signal and wall-clock conditions that end a run early with a checkpoint.

    Args:
        exit_signal_handler: install a SIGTERM handler (``--exit-signal-handler``).
        exit_duration_in_mins: wall-clock budget from ``start_time`` in minutes (fractions
            allowed), or None.
        start_time: ``time.time()`` at the start of the program.
        device: where the agreement tensor lives (the collective backend's device).
        sig: the signal to catch (SIGTERM, as Megatron-LM).
    """

    def __init__(self, exit_signal_handler: bool, exit_duration_in_mins: float | None,
                 start_time: float, device, sig=signal.SIGTERM):
        self.duration_s = None if exit_duration_in_mins is None else 60.0 * exit_duration_in_mins
        self.start_time, self.device, self.sig = start_time, device, sig
        self.received = False
        self._previous = None
        if exit_signal_handler:
            early = signal.getsignal(sig)
            self._previous = signal.signal(sig, self._on_signal)
            if isinstance(early, _EarlySignal):  # a signal during start-up counts
                self.received, self._previous = early.received, early.previous

    @property
    def enabled(self) -> bool:
        return self._previous is not None or self.duration_s is not None

    def _on_signal(self, signum, frame):  # only sets a flag: the iteration runs to its end
        self.received = True

    def check(self) -> str | None:
        """Collective over the world when enabled: the reason to stop now, agreed by every rank
        (``"signal"`` or ``"duration"``), or None to go on."""
        if not self.enabled:
            return None
        over_time = (self.duration_s is not None
                     and time.time() - self.start_time > self.duration_s)
        flags = torch.tensor([int(self.received), int(over_time)], dtype=torch.int32,
                             device=self.device)
        with collective_guard("the exit-condition all-reduce"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item():
            return "signal"
        if flags[1].item():
            return "duration"
        return None

    def restore(self) -> None:
        """Put back the previous signal handler."""
        if self._previous is not None:
            signal.signal(self.sig, self._previous)
            self._previous = None


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return "Timed out" in text or "timed out" in text or "Timeout" in text


@contextlib.contextmanager
def collective_guard(operation: str, timeout_minutes: float | None = None):
    """Re-raise a timed-out collective inside the block as :class:`CollectiveTimeoutError`.

    Args:
        operation: what the block does, for the message (e.g. ``"the train step of iteration 7"``).
        timeout_minutes: ``--distributed-timeout-minutes``, for the message only.

    Raises:
        CollectiveTimeoutError: naming this rank, ``operation``, the timeout and the original error.
    """
    try:
        yield
    except CollectiveTimeoutError:
        raise
    except RuntimeError as exc:
        if not _is_timeout(exc):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        limit = (f" within --distributed-timeout-minutes {timeout_minutes:g} "
                 f"({60 * timeout_minutes:g} s)" if timeout_minutes is not None else "")
        raise CollectiveTimeoutError(
            f"rank {rank}: a collective in {operation} did not complete{limit}; another rank is "
            f"stuck or dead (see its log). Original error: {exc}") from exc
