"""Asynchronous saving: copy the boxes to host memory, write them in a background thread.

:class:`BackgroundWrite` makes the host copy (:func:`stage_to_host`: a clone on CPU; on CUDA a
copy into pinned host buffers reused from one save to the next) while the training loop runs
the next forward and backward passes, then runs the write (``torch.distributed.checkpoint``'s
collectives included); the loop waits only if the copy is not done when its next optimizer step
is due. The write's collectives must run on a process group of their own (a gloo group made
for checkpoints): the training loop keeps issuing its own collectives meanwhile, and two threads
must never issue collectives on one group. Writing releases the GIL (file writes), so the loop
keeps most of its speed.

What to do when the write ends (publishing the checkpoint once *every* rank has finished) is the
caller's: :meth:`BackgroundWrite.state` is polled at iteration boundaries and agreed on by a
collective.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, List, Optional, Sequence

import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor

RUNNING, DONE, FAILED = 0, 1, -1


class HostBuffers:
    """Pinned host buffers for staging CUDA tensors, kept from one save to the next (pinning
    memory is slow: done once while the boxes keep their shapes)."""

    def __init__(self):
        self._buffers: List[torch.Tensor] = []

    def get(self, i: int, like: torch.Tensor) -> torch.Tensor:
        while len(self._buffers) <= i:
            self._buffers.append(torch.empty(0))
        buf = self._buffers[i]
        if buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self._buffers[i] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        return buf


def stage_to_host(tensors: Sequence[ShardedTensor],
                  buffers: Optional[HostBuffers] = None) -> List[ShardedTensor]:
    """Host copies of the boxes this rank writes (``replica_id == 0``; replicas are left out).

    CPU boxes are cloned (compact: a view of a larger storage copies only its elements); CUDA
    boxes are copied into ``buffers`` (pinned) without blocking, then the device is synchronised
    once. Memory: one copy of this rank's written bytes.
    """
    out, on_cuda = [], False
    for t in tensors:
        if t.replica_id:
            continue
        if t.data.is_cuda:
            on_cuda = True
            host = (buffers or HostBuffers()).get(len(out), t.data)
            host.copy_(t.data, non_blocking=True)
        else:
            host = t.data.detach().clone()
        out.append(t.with_data(host))
    if on_cuda:
        torch.cuda.synchronize()
    return out


WRITER_NICENESS = 10  # Megatron-LM's default for its checkpoint worker (--async-ckpt-cpu-priority)


def _lower_priority() -> None:
    """Lower this thread's CPU priority (Linux schedules threads one by one): the training
    loop's threads come first, the writer takes what they leave."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       min(19, os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICENESS))
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass


class BackgroundWrite:
    """One save running in a daemon thread (a crash of the process abandons it, which the staging
    folder makes harmless): first ``stage()`` (the host copy), then ``write(staged)``.

    The copy reads the live tensors while the training loop runs the next forward and backward
    passes, which do not change them; the loop must call :meth:`wait_staged` before the next
    optimizer step, which does (torchtitan's ``maybe_wait_for_staging``).

    Args:
        stage: returns the host copies (:func:`stage_to_host`).
        write: writes them; its exception, or ``stage``'s, is kept in ``error``.
    """

    def __init__(self, stage: Callable[[], list], write: Callable[[list], None]):
        self.error: Optional[BaseException] = None
        self.started = time.perf_counter()
        self.seconds: Optional[float] = None
        self.staged_seconds: Optional[float] = None
        self._staged = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stage, write), daemon=True,
                                        name="checkpoint-writer")
        self._thread.start()

    def _run(self, stage, write) -> None:
        try:
            try:
                staged = stage()  # at full priority: the next optimizer step waits for it
            finally:
                self.staged_seconds = time.perf_counter() - self.started
                self._staged.set()
            _lower_priority()
            write(staged)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - self.started

    def wait_staged(self) -> float:
        """Block until the host copy is complete (the live tensors may change again); the
        seconds waited."""
        start = time.perf_counter()
        self._staged.wait()
        return time.perf_counter() - start

    def state(self) -> int:
        """``RUNNING``, ``DONE`` or ``FAILED`` (non-blocking)."""
        if self._thread.is_alive():
            return RUNNING
        return FAILED if self.error is not None else DONE

    def wait(self) -> int:
        """Block until the save ends; its state."""
        self._thread.join()
        return self.state()
