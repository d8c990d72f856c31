"""The distributed optimizer's two collectives, in one place, with an optional recorder.

``reduce_scatter_bucket`` and ``all_gather_bucket`` issue the per-bucket reduce-scatter of
gradients and all-gather of parameters over the data-parallel group (ZeRO-1 / Megatron-LM's
distributed optimizer). On NCCL they run in place on the bucket as Megatron-Core does
(``reduce_scatter_tensor`` into the rank's shard view, ``all_gather_into_tensor`` from it). On other
backends (gloo) the output and input are kept apart (the shard is reduced into a scratch tensor
and copied back when the work is waited on) because gloo gives no aliasing guarantee; where the
backend lacks the collective altogether (gloo before torch 2.x) the reduce-scatter falls back to an
all-reduce of the bucket and the all-gather to a list all-gather; the result is the same.

Every call is reported to the recorder set by :func:`recording` as a dict
``{"op": "reduce_scatter" | "all_gather", "bucket": int, "numel": int, "dtype": torch.dtype,
"time": float}``, where
``numel`` is the whole bucket (the logical collective's size, padding included), so tests and
benchmarks can count exactly what the algorithm issues.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

_recorder: Optional[Callable[[dict], None]] = None

# torch >= 2.13 renamed the tensor collectives (the old names warn); same signatures.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# The same two, for the other collectives of megatron.core (context-parallel attention).
tensor_reduce_scatter = _reduce_scatter
tensor_all_gather = _all_gather


@contextlib.contextmanager
def recording():
    """Collect every collective issued inside the block; yields the (growing) list of events."""
    global _recorder
    events: List[dict] = []
    previous, _recorder = _recorder, events.append
    try:
        yield events
    finally:
        _recorder = previous


def _record(op: str, bucket: int, data: torch.Tensor) -> None:
    if _recorder is not None:
        _recorder({"op": op, "bucket": bucket, "numel": data.numel(), "dtype": data.dtype,
                   "time": time.perf_counter()})


class PendingCollective:
    """A launched collective; ``wait()`` completes it and runs its copy-back, once."""

    def __init__(self, work, finish: Optional[Callable[[], None]] = None):
        self.work, self.finish, self.done = work, finish, False

    def is_completed(self) -> bool:
        return self.done or self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        if self.finish is not None:
            self.finish()
        self.done = True


def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def reduce_scatter_bucket(bucket_data: torch.Tensor, rank: int, group, *, async_op: bool,
                          bucket: int = 0,
                          output: Optional[torch.Tensor] = None) -> PendingCollective:
    """Sum ``bucket_data`` over ``group``; rank r's shard ``[r*S, (r+1)*S)`` receives the result.

    Args:
        bucket_data: 1-D bucket, numel a multiple of the group size (S = numel / group size).
        rank: this rank's index in ``group``.
        group: the data-parallel group.
        async_op: return before the collective completes (wait on the result).
        bucket: bucket index, for the recorder.
        output: where the rank's reduced shard goes (S elements, a tensor of its own: the
            sharded-gradient strategies keep it after the bucket is freed); None: the shard view
            of ``bucket_data`` itself.

    Returns:
        a :class:`PendingCollective`; after ``wait()`` only the rank's own shard (or ``output``)
        is meaningful.
    """
    _record("reduce_scatter", bucket, bucket_data)
    size = bucket_data.numel() // dist.get_world_size(group)
    shard = bucket_data[rank * size:(rank + 1) * size]
    if output is not None:
        try:
            return PendingCollective(_reduce_scatter(output, bucket_data, group=group,
                                                     async_op=async_op))
        except (RuntimeError, NotImplementedError):  # backend without reduce-scatter
            work = dist.all_reduce(bucket_data, group=group, async_op=async_op)
            return PendingCollective(work, lambda: output.copy_(shard))
    if _is_nccl(group):
        return PendingCollective(_reduce_scatter(shard, bucket_data, group=group,
                                                 async_op=async_op))
    out = torch.empty_like(shard)
    try:
        work = _reduce_scatter(out, bucket_data, group=group, async_op=async_op)
    except (RuntimeError, NotImplementedError):  # backend without reduce-scatter
        work = dist.all_reduce(bucket_data, group=group, async_op=async_op)
        return PendingCollective(work)
    return PendingCollective(work, lambda: shard.copy_(out))


def all_gather_bucket(bucket_data: torch.Tensor, rank: int, group, *, async_op: bool,
                      bucket: int = 0, source: Optional[torch.Tensor] = None) -> PendingCollective:
    """Fill ``bucket_data`` with every rank's shard ``[r*S, (r+1)*S)`` (inverse of the scatter).

    Args: as :func:`reduce_scatter_bucket`; rank r's shard of ``bucket_data`` is the input, or
    ``source`` (S elements kept apart from the bucket: the sharded-parameter strategy's shard).
    """
    _record("all_gather", bucket, bucket_data)
    world = dist.get_world_size(group)
    size = bucket_data.numel() // world
    shard = bucket_data[rank * size:(rank + 1) * size]
    if _is_nccl(group):
        return PendingCollective(_all_gather(bucket_data, shard if source is None else source,
                                             group=group, async_op=async_op))
    source = shard.clone() if source is None else source
    try:
        work = _all_gather(bucket_data, source, group=group, async_op=async_op)
    except (RuntimeError, NotImplementedError):  # backend without all_gather_into_tensor
        outs = list(bucket_data.split(size))
        work = dist.all_gather(outs, source, group=group, async_op=async_op)
    return PendingCollective(work)
