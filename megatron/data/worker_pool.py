"""A pool of preprocessing worker processes that never waits forever for a lost chunk.

Used by ``tools/preprocess_data.py`` and ``tools/preprocess_sft_data.py`` (``--workers N``).
``multiprocessing.Pool`` replaces a worker that died (the out-of-memory killer's SIGKILL) and waits
for its chunk forever; this pool is a ``concurrent.futures.ProcessPoolExecutor``, where a dead
worker fails every pending chunk at once, and it names that worker's exit.

- Workers ignore SIGINT (the main process handles Ctrl-C and ends the pool itself), take SIGTERM's
  default action, and are SIGKILLed by the kernel when the main process dies
  (:func:`megatron.data.loader_workers.die_with_parent`), so none is orphaned.
- A worker stopped from outside (SIGSTOP, a debugger) would hold its chunk forever without dying:
  when one has been stopped for ``stopped_limit_s`` seconds the pool stops the run, naming it
  (``/proc/PID/stat`` state ``T`` or ``t``; where ``/proc`` is absent nothing is checked). A whole
  job suspended and resumed together (Ctrl-Z, then ``fg``) is not affected: the main process is
  stopped with its workers and checks nothing meanwhile.

Nothing here imports torch.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from typing import Callable, Optional

STOPPED_LIMIT_S = 60.0  # a worker stopped longer than this ends the run
_POLL_S = 2.0           # how often a waiting main process looks at its workers
EXIT_GRACE_S = 10.0     # a worker asked to exit that is still alive this much later is SIGKILLed


class WorkerDied(RuntimeError):
    """A worker process ended, or stayed stopped, while it held a chunk (the out-of-memory killer,
    a crash, a SIGSTOP). The message is one line naming the worker's pid and what happened."""


def _start_worker(initializer: Optional[Callable], initargs: tuple,
                  parent_pid: Optional[int]) -> None:
    # First of all: a SIGTERM from here on takes its default action, not the main process's
    # handler this process was forked with.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    from megatron.data.loader_workers import die_with_parent

    die_with_parent(parent_pid=parent_pid)  # a SIGKILLed main process leaves no worker behind
    if initializer is not None:
        initializer(*initargs)


def process_state(pid: int) -> Optional[str]:
    """The one-letter state of process ``pid`` from ``/proc/PID/stat`` (``R``, ``S``, ``T`` ...),
    or None where it cannot be read (no ``/proc``, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ")".
    after = stat.rpartition(b")")[2].split()
    return after[0].decode("ascii", "replace") if after else None


class WorkerPool:
    """``workers`` processes running ``initializer(*initargs)`` once each, then tasks.

    Args:
        workers: number of processes (>= 2; with one, callers work in their own process).
        initializer / initargs: the per-worker set-up (e.g. building the tokenizer).
        what: the workers' name in messages ("tokenizer worker").
        advice: what the message of a dead worker tells the user to do.
        stopped_limit_s: a worker stopped this long ends the run with :class:`WorkerDied`
            (default :data:`STOPPED_LIMIT_S`).

    Raises:
        WorkerDied: from :meth:`submit` and :meth:`result` once a worker has died or stayed
            stopped; the pool is then shut down and every other worker ended.
    """

    def __init__(self, workers: int, initializer: Optional[Callable] = None, initargs: tuple = (),
                 what: str = "worker", advice: str = "rerun, with fewer --workers if memory ran out",
                 stopped_limit_s: Optional[float] = None):
        from concurrent.futures import ProcessPoolExecutor

        self.what, self.advice = what, advice
        self.stopped_limit_s = STOPPED_LIMIT_S if stopped_limit_s is None else stopped_limit_s
        from megatron.data.loader_workers import helper_parent_pid

        self.executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(),
                                            initializer=_start_worker,
                                            initargs=(initializer, initargs, helper_parent_pid()))
        # Start every worker now (fork: all at the first task), before output files are open.
        import os

        started = self.executor.submit(os.getpid)
        self.processes = list(self.executor._processes.values())
        self.result(started)

    def submit(self, fn: Callable, *args):
        """``executor.submit(fn, *args)``."""
        return self._named(self.executor.submit, fn, *args)

    def result(self, future):
        """``future.result()``, looking at the workers every few seconds while it waits."""
        from concurrent.futures import TimeoutError as FutureTimeout

        stopped_since: dict = {}
        while True:
            try:
                return self._named(future.result, min(_POLL_S, self.stopped_limit_s))
            except FutureTimeout:
                self._check_stopped(stopped_since)

    def ordered(self, fn: Callable, items, window: int):
        """``fn(*item)`` for each of ``items`` in input order, at most ``window`` in flight."""
        import collections

        pending = collections.deque()
        for item in items:
            if len(pending) >= window:
                yield self.result(pending.popleft())
            pending.append(self.submit(fn, *item))
        while pending:
            yield self.result(pending.popleft())

    def close(self) -> None:
        """Let the workers finish and exit (their CPU time then shows in rusage); one that has not
        exited ``EXIT_GRACE_S`` after the last result is SIGKILLed."""
        self.executor.shutdown(wait=False)
        self._end_workers(signal_first=False)

    def terminate(self) -> None:
        """Stop now: SIGKILL stopped workers (a stopped one ignores SIGTERM until continued),
        SIGTERM the others, drop the pending chunks."""
        self._end_workers(signal_first=True)

    def _end_workers(self, signal_first: bool) -> None:
        """SIGTERM the workers (``signal_first``), SIGKILL any still alive ``EXIT_GRACE_S`` later,
        then shut the executor down. A stopped worker ignores SIGTERM until continued, and a
        worker forked while another thread of this process held a lock can hang before it runs
        a line of Python (its inherited Python SIGTERM handler then never runs): without the
        SIGKILL the executor's shutdown would wait for them forever."""
        if signal_first:
            # The chunks still queued for the workers are dropped: without this the executor's
            # shutdown joins the queue's feeder thread, which waits to write them into a pipe
            # no worker reads any more (a known multiprocessing hang).
            call_queue = getattr(self.executor, "_call_queue", None)
            if call_queue is not None:
                call_queue.cancel_join_thread()
            for process in self.processes:
                if process.exitcode is None:
                    process.terminate()
        deadline = time.monotonic() + EXIT_GRACE_S
        for process in self.processes:
            while process.exitcode is None and time.monotonic() < deadline \
                    and process_state(process.pid) not in ("T", "t"):
                time.sleep(0.02)
            if process.exitcode is None:
                process.kill()
        if signal_first:
            for process in self.processes:
                process.join(EXIT_GRACE_S)
            # A worker ended while it wrote a result leaves half a message in the result pipe:
            # the executor's thread then waits in recv() for the rest forever, and shutdown
            # with it (seen once in 18 Ctrl-C runs). With every worker gone, closing this
            # process's copy of the pipe's write end turns that wait into EOF, which the
            # executor takes as a broken pool and cleans up.
            writer = getattr(getattr(self.executor, "_result_queue", None), "_writer", None)
            if writer is not None and all(p.exitcode is not None for p in self.processes):
                writer.close()
        self.executor.shutdown(wait=True, cancel_futures=True)

    def _named(self, call, *args):
        from concurrent.futures.process import BrokenProcessPool

        try:
            return call(*args)
        except BrokenProcessPool:
            raise self._died() from None

    def _check_stopped(self, stopped_since: dict) -> None:
        now = time.monotonic()
        for process in self.processes:
            if process_state(process.pid) not in ("T", "t"):
                stopped_since.pop(process.pid, None)
                continue
            since = stopped_since.setdefault(process.pid, now)
            if now - since >= self.stopped_limit_s:
                self.terminate()
                raise WorkerDied(
                    f"{self.what} (pid {process.pid}) has been stopped (SIGSTOP or a debugger) for "
                    f"{now - since:.0f} s while holding a chunk; stopped the run, no output "
                    "written; rerun, and do not stop single workers (suspend the whole job with "
                    "Ctrl-Z instead)")

    def _died(self) -> WorkerDied:
        """Name the worker that broke the pool (the first that did not end by our SIGTERM)."""
        self._end_workers(signal_first=True)
        codes = [(p.pid, p.exitcode) for p in self.processes]
        pid, code = next(((pid, c) for pid, c in codes if c not in (None, 0, -signal.SIGTERM)),
                         next(((pid, c) for pid, c in codes if c), (None, None)))
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
            if -code == signal.SIGKILL:
                how += " (the out-of-memory killer sends it when memory runs out)"
        else:
            how = f"exited with status {code}"
        return WorkerDied(f"{self.what} (pid {pid}) {how}; stopped, no output written; {self.advice}")
