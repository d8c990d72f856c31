"""Contiguous gradient (and optionally parameter) buffers cut into buckets for data parallelism.

Layout (after Megatron-Core's ``ParamAndGradBuffer``): the parameters of one dtype pair are laid
out in *reverse* registration order, so the parameters whose gradients are produced first in the
backward pass sit at the start of the buffer and fill the first bucket. A parameter never straddles
two buckets. A bucket closes once it holds at least ``bucket_size`` elements; its end is padded with
zeros to a multiple of the data-parallel size ``N``, so every bucket splits into ``N`` equal shards
(rank ``r`` owns shard ``r``). The distributed optimizer reduce-scatters a bucket into those shards
and, after its step, all-gathers the updated parameter shards back into the bucket's
``param_data``; plain data parallelism all-reduces the whole bucket. Padding costs at most ``N - 1``
elements per bucket.

With the distributed optimizer a parameter marked ``shared_embedding`` (the tied embedding at
PP > 1) gets a bucket of its own, as in Megatron-Core: its shard ranges are then the same on the
first and last pipeline stage, so the embedding-group all-reduce that follows the reduce-scatter
sums matching elements.

Example, params a (3 elements), b (4), c (2) registered in that order, ``bucket_size=5``, N=2::

    buffer:  [c c | b b b b] [a a a pad]      bucket 0 = c, b (6 elements); bucket 1 = a (+1 pad)
    shards:   bucket 0 -> rank 0 [0, 3), rank 1 [3, 6); bucket 1 -> rank 0 [6, 8), rank 1 [8, 10)

Sharded gradients and parameters (ZeRO-2 / ZeRO-3, ``shard_grads`` / ``shard_params``; see
:mod:`megatron.core.distributed.param_units` for the design): every bucket then owns its storage
(no buffer-wide tensor), so one bucket's full gradient or parameter storage can be freed
(``untyped_storage().resize_(0)``, the views ``param.data`` / ``param.main_grad`` stay valid
objects) and re-allocated on its own. The rank's shard lives apart in ``grad_shard`` /
``param_shard`` (``shard_range(r)`` of the bucket, padding included): the reduce-scatter writes
``grad_shard``, the all-gather reads ``param_shard``. Without sharding both are views of the
bucket.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.distributed.collectives import all_gather_bucket, reduce_scatter_bucket
from megatron.core.process_groups import group_rank, group_size

# Megatron-Core's default bucket: at least this many elements (and 1e6 per data-parallel rank),
# i.e. one bucket for small models. The one definition: DDP, the planner and the docs read it.
DEFAULT_BUCKET_SIZE = 40_000_000


def _free(t: torch.Tensor) -> None:
    """Release ``t``'s memory; its views stay valid objects (not to be read until re-allocated)."""
    t.untyped_storage().resize_(0)


def _allocate(t: torch.Tensor) -> bool:
    """Give a freed ``t`` its memory back (contents undefined); False if it had it."""
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.size() == nbytes:
        return False
    storage.resize_(nbytes)
    return True


def allocated_bytes(t: Optional[torch.Tensor]) -> int:
    """Bytes of memory ``t``'s storage holds now (0 when freed or None)."""
    return 0 if t is None else t.untyped_storage().nbytes()


class GradStorageMeter:
    """Bytes of gradient storage one DDP wrapper holds (full bucket storage and ZeRO-2/3's
    ``grad_shard``), kept current from the storages' own sizes before and after every
    allocation and release, and its peak.

    Attributes:
        current: bytes held now.
        peak: the most bytes held at once since :meth:`reset_peak`.
    """

    def __init__(self, current: int = 0):
        self.current = self.peak = current

    def changed(self, delta: int) -> None:
        self.current += delta
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        self.peak = self.current


def default_bucket_size(data_parallel_size: int) -> int:
    """Elements per gradient bucket when ``--reduce-bucket-size`` is not given:
    ``max(DEFAULT_BUCKET_SIZE, 1e6 * data_parallel_size)`` (Megatron-Core's rule)."""
    return max(DEFAULT_BUCKET_SIZE, 1_000_000 * data_parallel_size)


class Bucket:
    """A contiguous slice of a grad buffer whose gradients are reduced by one collective.

    Attributes:
        params: the parameters of the bucket, in buffer order.
        grad_data: view of the grad buffer ``[offset, offset + numel_padded)``.
        param_data: same view of the param buffer, or None when there is no param buffer.
        offset: first element of the bucket in the buffer.
        numel_unpadded: elements actually used by parameters.
        numel_padded: ``numel_unpadded`` rounded up to a multiple of the data-parallel size.
        index: bucket number within its buffer (0 = first to be ready in the backward pass).
    """

    def __init__(self, params: List[torch.nn.Parameter], grad_data: torch.Tensor,
                 param_data: Optional[torch.Tensor], offset: int, numel_unpadded: int, index: int,
                 data_parallel_group, gradient_scaling_factor: float, use_avg_op: bool,
                 reduce_scatter: bool = False, shard_grads: bool = False,
                 shard_params: bool = False):
        self.params = params
        self.params_set = set(params)
        self.grad_data = grad_data
        self.param_data = param_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.numel_padded = grad_data.numel()
        self.index = index
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = group_size(data_parallel_group)
        self.gradient_scaling_factor = gradient_scaling_factor
        self.use_avg_op = use_avg_op
        self.reduce_scatter = reduce_scatter
        self.data_parallel_rank = group_rank(data_parallel_group)
        self.param_handle = None
        self.shard_grads = shard_grads
        self.shard_params = shard_params and param_data is not None
        lo, hi = self.shard_range(self.data_parallel_rank)
        self.grad_shard = (torch.zeros(hi - lo, dtype=grad_data.dtype, device=grad_data.device)
                           if shard_grads else grad_data[lo:hi])
        self.param_shard = None
        if param_data is not None:
            self.param_shard = param_data[lo:hi].clone() if self.shard_params else param_data[lo:hi]
        self.params_gathered = True  # the sharded-parameter buffer frees them once built
        self.grad_meter: Optional["GradStorageMeter"] = None  # set by DDP
        self.handle = None
        self.reset()

    def reset(self) -> None:
        """Forget the readiness and in-flight state of the previous iteration."""
        self.params_with_grad = set()
        if not self.shard_grads:  # (a sharded bucket's reduction is completed, never dropped)
            self.handle = None
        self.launched = False

    def zero_sharded_grads(self) -> None:
        """Start of an iteration with sharded gradients: zero the shard; the full gradient
        storage stays freed until a gradient of the bucket is written
        (:meth:`allocate_grads`)."""
        self.complete_grad_reduction()
        self.grad_shard.zero_()
        self.free_grads()

    def allocate_grads(self) -> None:
        """Sharded gradients: give the bucket's full gradient storage back, zeroed, before a
        gradient is written into it (no-op if it has it). A reduce-scatter of the bucket still in
        flight (``--overlap-grad-reduce``) is completed first: its storage is being read."""
        self.complete_grad_reduction()
        before = allocated_bytes(self.grad_data)
        if _allocate(self.grad_data):
            self.grad_data.zero_()
            self._metered(before, self.grad_data)

    def free_grads(self) -> None:
        """Sharded gradients: release the full gradient storage (after the reduce-scatter)."""
        if self.shard_grads:
            before = allocated_bytes(self.grad_data)
            _free(self.grad_data)
            self._metered(before, self.grad_data)

    def _metered(self, before: int, t: torch.Tensor) -> None:
        if self.grad_meter is not None:
            self.grad_meter.changed(allocated_bytes(t) - before)

    def grads_pending(self) -> bool:
        """Sharded gradients: the full storage holds gradients not yet reduced into the shard
        (it is allocated: written since the last reduce-scatter)."""
        return self.handle is None and allocated_bytes(self.grad_data) > 0

    def reduce_scatter_into_shard(self, async_op: bool) -> None:
        """Sharded gradients, once per micro-batch (ZeRO-2/3, Megatron-FSDP's ``optim_grads``):
        scale the bucket, reduce-scatter it over the data-parallel group and add the rank's
        reduced shard into ``grad_shard`` (:meth:`complete_grad_reduction`, now or when the
        work is waited on with ``async_op``), then free the full storage.

        Collective: reduce-scatter (sum) of ``numel_padded`` elements of ``grad_dtype`` (a copy
        at DP = 1). The reduction order differs from ZeRO-1's: per micro-batch sums over ranks,
        then a sum over micro-batches in the shard (equal at one micro-batch: ``0 + x = x``).
        """
        self.params_with_grad = set()
        if self.data_parallel_world_size == 1:
            # An expert buffer whose expert-DP is 1 still scales by 1 / DP (EP folded over DP).
            if self.gradient_scaling_factor != 1.0:
                self.grad_data.mul_(self.gradient_scaling_factor)
            self.grad_shard.add_(self.grad_data)
            self.free_grads()
            return
        if self.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(self.gradient_scaling_factor)
        # Into the bucket's own shard view (no extra storage), added into grad_shard after.
        self.handle = reduce_scatter_bucket(self.grad_data, self.data_parallel_rank,
                                            self.data_parallel_group, async_op=async_op,
                                            bucket=self.index)
        if not async_op:
            self.complete_grad_reduction()

    def complete_grad_reduction(self) -> None:
        """Sharded gradients: wait for the bucket's reduce-scatter in flight (if any), add the
        reduced shard into ``grad_shard`` and free the full storage."""
        if not self.shard_grads or self.handle is None:
            return
        self.handle.wait()
        self.handle = None
        lo, hi = self.shard_range(self.data_parallel_rank)
        self.grad_shard.add_(self.grad_data[lo:hi])
        self.free_grads()

    def gather_params(self, async_op: bool) -> None:
        """Sharded parameters: allocate the full parameter storage and all-gather every rank's
        ``param_shard`` into it (no-op if gathered). Collective: all-gather over the
        data-parallel group (a copy at DP = 1)."""
        if self.params_gathered:
            return
        _allocate(self.param_data)
        self.params_gathered = True
        if self.data_parallel_world_size == 1:
            self.param_data.copy_(self.param_shard)
            return
        self.param_handle = all_gather_bucket(self.param_data, self.data_parallel_rank,
                                              self.data_parallel_group, async_op=async_op,
                                              bucket=self.index, source=self.param_shard)

    def free_params(self) -> None:
        """Sharded parameters: release the full parameter storage (the shard stays)."""
        if self.shard_params and self.params_gathered:
            self.finish_param_sync()
            _free(self.param_data)
            self.params_gathered = False

    def write_shard_from_params(self) -> None:
        """Sharded parameters: copy the gathered full parameters' shard into ``param_shard``
        (after the full parameters were loaded from a checkpoint)."""
        lo, hi = self.shard_range(self.data_parallel_rank)
        self.param_shard.copy_(self.param_data[lo:hi])

    def shard_range(self, data_parallel_rank: int) -> Tuple[int, int]:
        """``(start, end)`` of rank ``data_parallel_rank``'s shard, in elements within the bucket."""
        size = self.numel_padded // self.data_parallel_world_size
        return data_parallel_rank * size, (data_parallel_rank + 1) * size

    def start_grad_sync(self, async_op: bool) -> None:
        """Scale the bucket and launch its reduction over the data-parallel group.

        Collective: all-reduce (sum, or average with ``use_avg_op``) of ``grad_data`` over the
        data-parallel group, after scaling by ``gradient_scaling_factor``; with ``reduce_scatter``
        a reduce-scatter (sum) instead, after which only this rank's shard is meaningful.
        """
        if self.shard_grads:  # what was written since the last reduce-scatter, if anything
            if self.grads_pending():
                self.reduce_scatter_into_shard(async_op)
            return
        if self.launched:
            return
        self.launched = True
        if self.data_parallel_world_size == 1:
            # An expert buffer whose expert-DP is 1 still scales by 1 / DP (EP folded over DP).
            if self.gradient_scaling_factor != 1.0:
                self.grad_data.mul_(self.gradient_scaling_factor)
            return
        op = dist.ReduceOp.SUM
        if self.use_avg_op:
            op = dist.ReduceOp.AVG
        elif self.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(self.gradient_scaling_factor)
        if self.reduce_scatter:
            if self.use_avg_op:
                raise ValueError("average_in_collective is not available with the distributed "
                                 "optimizer; leave it False")
            self.handle = reduce_scatter_bucket(
                self.grad_data, self.data_parallel_rank, self.data_parallel_group,
                async_op=async_op, bucket=self.index)
            return
        self.handle = dist.all_reduce(self.grad_data, op=op, group=self.data_parallel_group,
                                      async_op=async_op)

    def finish_grad_sync(self) -> None:
        """Launch the collective if it was not launched yet, then wait for it; with sharded
        gradients the last micro-batch's pending gradients are reduced into ``grad_shard`` and
        the full gradient storage is freed (only ``grad_shard`` remains)."""
        self.start_grad_sync(async_op=False)
        if self.shard_grads:
            self.complete_grad_reduction()
            return
        if self.handle is not None:
            self.handle.wait()
        self.handle = None

    def start_param_sync(self, async_op: bool) -> None:
        """Launch the all-gather of the updated parameter shards into ``param_data``.

        Collective: all-gather over the data-parallel group (no-op at DP = 1, and with sharded
        parameters, which are gathered by the next forward instead).
        """
        if self.data_parallel_world_size == 1 or self.param_data is None or self.shard_params:
            return
        self.finish_param_sync()
        self.param_handle = all_gather_bucket(self.param_data, self.data_parallel_rank,
                                              self.data_parallel_group, async_op=async_op,
                                              bucket=self.index)

    def param_sync_pending(self) -> bool:
        return self.param_handle is not None and not self.param_handle.is_completed()

    def finish_param_sync(self) -> None:
        """Wait for this bucket's parameter all-gather, if one is in flight."""
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None

    def register_grad_ready(self, param: torch.nn.Parameter, async_op: bool) -> None:
        """Mark ``param``'s gradient final; launch the bucket once every parameter is ready."""
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync(async_op=async_op)


class ParamAndGradBuffer:
    """One contiguous gradient buffer (and optional parameter buffer) for params of one dtype pair.

    Args:
        params: parameters to place (all with the same dtype), in registration order.
        grad_dtype: dtype of the gradient buffer (fp32 to accumulate and reduce in fp32).
        data_parallel_group: the group the buckets are reduced over (None: a world of one).
        bucket_size: close a bucket once it holds at least this many elements; None means one
            bucket for the whole buffer.
        gradient_scaling_factor: multiplier applied to a bucket before its sum all-reduce
            (``1 / DP`` to average).
        use_avg_op: reduce with ``ReduceOp.AVG`` instead of scaling then summing (NCCL only).
        use_param_buffer: also move the parameters' storage into one contiguous buffer
            (``param.data`` becomes a view), as the distributed optimizer's all-gather needs.
        reduce_scatter: reduce-scatter the buckets instead of all-reducing them (distributed
            optimizer); also gives a ``shared_embedding`` parameter a bucket of its own.
        shard_grads: keep only ``grad_shard`` of each bucket after its reduce-scatter (ZeRO-2;
            needs ``reduce_scatter``).
        shard_params: keep only ``param_shard`` of each bucket between uses (ZeRO-3; needs
            ``shard_grads`` and ``use_param_buffer``): the buckets start freed.
        unit_of: ``param -> unit index`` (ZeRO-3): a bucket closes where the unit changes (and
            never by size), so a unit is whole buckets; the params must come unit by unit.
        is_expert: the buffer holds expert parameters (reduced over the expert-data-parallel
            group ``data_parallel_group`` then is); recorded for the optimizer's parts.

    Attributes:
        grad_data: the 1-D gradient buffer, ``numel`` elements of ``grad_dtype`` (None with
            sharding: each bucket owns its storage).
        param_data: the 1-D parameter buffer or None (None with sharding too).
        buckets: list of :class:`Bucket` in buffer order (= readiness order in the backward).
        param_index_map: ``param -> (start, end, bucket index)`` in elements within the buffer.
    """

    def __init__(self, params: List[torch.nn.Parameter], grad_dtype: torch.dtype,
                 data_parallel_group, bucket_size: Optional[int],
                 gradient_scaling_factor: float, use_avg_op: bool = False,
                 use_param_buffer: bool = False, reduce_scatter: bool = False,
                 shard_grads: bool = False, shard_params: bool = False,
                 unit_of: Optional[Dict[torch.nn.Parameter, int]] = None,
                 is_expert: bool = False):
        if not params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        self.param_dtype = params[0].dtype
        if any(p.dtype != self.param_dtype for p in params):
            raise ValueError("all parameters of one ParamAndGradBuffer must share a dtype")
        self.grad_dtype = grad_dtype
        self.params = list(params)
        self.is_expert = is_expert
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = group_size(data_parallel_group)
        self.gradient_scaling_factor = gradient_scaling_factor
        device = params[0].device

        if (shard_grads and not reduce_scatter) or (shard_params and not (
                shard_grads and use_param_buffer)):
            raise ValueError("sharded gradients need reduce_scatter; sharded parameters need "
                             "sharded gradients and the parameter buffer")
        self.reduce_scatter = reduce_scatter
        self.sharded = shard_grads or shard_params
        layout, bucket_bounds = self._layout(bucket_size, unit_of)
        self.param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = layout
        self.numel = bucket_bounds[-1][1] if bucket_bounds else 0
        self.numel_unpadded = sum(p.numel() for p in params)

        def storage(dtype, start, end):  # one buffer, or one tensor per bucket when sharded
            return torch.zeros(end - start, dtype=dtype, device=device)

        self.grad_data = None if self.sharded else storage(grad_dtype, 0, self.numel)
        self.param_data = None
        if use_param_buffer and not self.sharded:
            self.param_data = storage(self.param_dtype, 0, self.numel)
        grads, datas = [], []
        for start, end in bucket_bounds:
            grads.append(storage(grad_dtype, start, end) if self.sharded
                         else self.grad_data[start:end])
            datas.append(None if not use_param_buffer else
                         storage(self.param_dtype, start, end) if self.sharded
                         else self.param_data[start:end])

        for p, (start, end, b) in layout.items():
            offset = bucket_bounds[b][0]
            if datas[b] is not None:
                view = datas[b][start - offset:end - offset].view(p.shape)
                view.copy_(p.data)
                p.data = view
            p.main_grad = grads[b][start - offset:end - offset].view(p.shape)

        self.buckets: List[Bucket] = []
        for i, (start, end) in enumerate(bucket_bounds):
            members = [p for p, (_, _, b) in layout.items() if b == i]
            used = sum(p.numel() for p in members)
            self.buckets.append(Bucket(members, grads[i], datas[i], start, used, i,
                                       data_parallel_group, gradient_scaling_factor, use_avg_op,
                                       reduce_scatter, shard_grads, shard_params))
        self.param_to_bucket = {p: self.buckets[b] for p, (_, _, b) in layout.items()}
        for b in self.buckets:
            if b.shard_params:  # ZeRO-3: from here on only the shards are held
                b.free_params()
            if b.shard_grads:  # allocated when a gradient is first written into the bucket
                _free(b.grad_data)

    def _layout(self, bucket_size, unit_of=None):
        """Assign ``(start, end, bucket)`` to every param; return it and the padded bucket bounds."""
        n = self.data_parallel_world_size
        layout, bounds = {}, []
        bucket_start = cursor = 0

        def close_bucket():
            nonlocal bucket_start, cursor
            cursor = -(-cursor // n) * n  # pad to a multiple of the DP size
            bounds.append((bucket_start, cursor))
            bucket_start = cursor

        # Reverse order: gradients arrive roughly in reverse registration order in backward.
        unit = None
        for p in reversed(self.params):
            alone = self.reduce_scatter and getattr(p, "shared_embedding", False)
            new_unit = unit_of is not None and unit_of[p] != unit
            if (alone or new_unit) and cursor > bucket_start:
                close_bucket()
            unit = None if unit_of is None else unit_of[p]
            layout[p] = (cursor, cursor + p.numel(), len(bounds))
            cursor += p.numel()
            by_size = unit_of is None and bucket_size is not None
            if alone or (by_size and cursor - bucket_start >= bucket_size):
                close_bucket()
        if cursor > bucket_start:
            close_bucket()
        return layout, bounds

    def reset(self) -> None:
        """Zero the gradient buffer and forget the bucket states (start of an iteration)."""
        if self.grad_data is not None:
            self.grad_data.zero_()
        for b in self.buckets:
            b.reset()
            if b.shard_grads:
                b.zero_sharded_grads()

    def start_grad_sync(self, async_op: bool) -> None:
        for b in self.buckets:
            b.start_grad_sync(async_op)

    def finish_grad_sync(self) -> None:
        for b in self.buckets:
            b.finish_grad_sync()
        for b in self.buckets:
            b.reset()

    def start_param_sync(self, async_op: bool) -> None:
        """Launch every bucket's parameter all-gather, in forward order (last bucket first)."""
        for b in reversed(self.buckets):
            b.start_param_sync(async_op)

    def finish_param_sync(self) -> None:
        for b in self.buckets:
            b.finish_param_sync()

    def register_grad_ready(self, param: torch.nn.Parameter, async_op: bool) -> None:
        self.param_to_bucket[param].register_grad_ready(param, async_op)

    def scale_gradients(self, factor: float) -> None:
        """Multiply the gradients by ``factor`` (with sharded gradients: the shards, which are
        all there is after the reduce-scatter)."""
        if self.grad_data is not None:
            self.grad_data.mul_(factor)
        for b in self.buckets:
            if b.shard_grads:
                b.grad_shard.mul_(factor)
