"""Token dispatchers: send each kept choice (token, slot) to the rank holding its expert and
bring the expert's output back (Megatron-Core's ``MoEAlltoAllTokenDispatcher`` and
``MoEAllGatherTokenDispatcher``).

Both work on *choices*: the k (token, expert) pairs of each of the T local tokens, numbered
``t k + j``. ``dispatch`` returns the rows for this rank's experts, sorted by local expert, and
how many each expert has; ``combine`` returns ``[T k, h]`` fp32, row ``t k + j`` the output of
choice j of token t (zero when the choice was dropped). The caller weights and sums the k rows of
a token in fp32 in slot order, so the result does not depend on which rank ran which expert.

The expert-parallel group ``ep_group`` (None: a world of one) holds ``E / EP`` experts per rank,
rank r experts ``r E/EP .. (r+1) E/EP - 1``. Splits may be uneven and zero: a rank that receives
no row runs its experts on an empty input and still returns (zero) weight gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.process_groups import group_rank, group_size
from megatron.core.tensor_parallel.mappings import (all_gather_first_dim,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; backward sends the gradients back (splits
    swapped)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(x, output_splits, input_splits, group):
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
    """``x [sum(input_splits), ...]`` -> ``[sum(output_splits), ...]``: rows
    ``input_splits[r]`` go to rank r of ``group``, with autograd."""
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def _sort_choices(indices: torch.Tensor, keep: torch.Tensor, lo: int, hi: int, num_experts: int):
    """The kept choices for experts ``lo .. hi-1``, sorted by expert (then choice number):
    ``(choice ids, experts, counts [hi - lo])``."""
    flat = indices.reshape(-1)
    mine = keep.reshape(-1) & (flat >= lo) & (flat < hi)
    ids = mine.nonzero().squeeze(1)
    experts = flat[ids]
    order = torch.sort(experts, stable=True).indices
    ids, experts = ids[order], experts[order]
    counts = torch.bincount(experts - lo, minlength=hi - lo)
    return ids, experts - lo, counts


def _scale_rows(rows, ids, input_probs):
    if input_probs is None:
        return rows
    return rows * input_probs.reshape(-1)[ids].unsqueeze(1).to(rows.dtype)


class MoEAlltoAllTokenDispatcher:
    """All-to-all over the expert-parallel group.

    Args:
        num_experts: E. ep_group: the expert-parallel group (None: one rank).
        pad_to_capacity: ``--moe-pad-expert-input-to-capacity``: every expert gets exactly
            ``capacity`` rows from each source rank (zero rows after the real ones).
    """

    def __init__(self, num_experts: int, ep_group=None, pad_to_capacity: bool = False):
        self.num_experts, self.ep_group = num_experts, ep_group
        self.ep_size = group_size(ep_group)
        self.num_local_experts = num_experts // self.ep_size
        self.pad_to_capacity = pad_to_capacity

    def dispatch(self, x, indices, keep, capacity=None, input_probs=None):
        """``x [T, h]``, ``indices``/``keep`` ``[T, k]``, ``input_probs`` ``[T, k]`` or None
        (multiply each choice's row by it: ``--moe-apply-probs-on-input``) ->
        ``(rows [M, h] by local expert, tokens_per_expert [E_local] int64)``."""
        k, ep, local = indices.shape[1], self.ep_size, self.num_local_experts
        ids, experts, counts = _sort_choices(indices, keep, 0, self.num_experts, self.num_experts)
        rows = _scale_rows(x.index_select(0, ids // k), ids, input_probs)
        self.padded_slots = None
        if self.pad_to_capacity:
            starts = torch.cumsum(counts, 0) - counts
            slots = experts * capacity + torch.arange(ids.numel()) - starts[experts]
            rows = rows.new_zeros(self.num_experts * capacity, rows.shape[1]).index_copy(
                0, slots, rows)
            counts = torch.full_like(counts, capacity)
            self.padded_slots = slots
        self.ids, self.num_choices = ids, indices.numel()
        recv = _all_to_all(counts, [local] * ep, [local] * ep, self.ep_group).view(ep, local)
        self.send_splits = counts.view(ep, local).sum(1).tolist()
        self.recv_splits = recv.sum(1).tolist()
        received = all_to_all(rows, self.recv_splits, self.send_splits, self.ep_group)
        # Received rows come by (source rank, local expert); the experts want (expert, source).
        segments = torch.repeat_interleave(torch.arange(ep * local), recv.reshape(-1))
        key = (segments % local) * ep + segments // local
        self.perm = torch.sort(key, stable=True).indices
        return received.index_select(0, self.perm), recv.sum(0)

    def combine(self, y):
        """``y [M, h]`` (the experts' output, as dispatched) -> ``[T k, h]`` fp32."""
        back = y.new_zeros(y.shape).index_copy(0, self.perm, y)
        returned = all_to_all(back, self.send_splits, self.recv_splits, self.ep_group)
        if self.padded_slots is not None:
            returned = returned.index_select(0, self.padded_slots)
        out = returned.new_zeros(self.num_choices, y.shape[1], dtype=torch.float32)
        return out.index_copy(0, self.ids, returned.float())


class MoEAllGatherTokenDispatcher:
    """All-gather over the expert-parallel group: every rank sees every rank's tokens (equal T
    on every rank), runs its own experts on their choices, and a reduce-scatter (a sum in which
    each choice has one non-zero term, hence exact) returns each rank its tokens' outputs."""

    def __init__(self, num_experts: int, ep_group=None):
        self.num_experts, self.ep_group = num_experts, ep_group
        self.ep_size = group_size(ep_group)
        self.num_local_experts = num_experts // self.ep_size
        self.first = group_rank(ep_group) * self.num_local_experts if self.ep_size > 1 else 0

    def dispatch(self, x, indices, keep, capacity=None, input_probs=None):
        """As :meth:`MoEAlltoAllTokenDispatcher.dispatch` (no padding)."""
        k, group = indices.shape[1], self.ep_group
        all_x = gather_from_sequence_parallel_region(x, group)
        all_indices = all_gather_first_dim(indices.contiguous(), group)
        all_keep = all_gather_first_dim(keep.to(torch.uint8).contiguous(), group).bool()
        if input_probs is not None:
            input_probs = gather_from_sequence_parallel_region(input_probs, group)
        ids, _, counts = _sort_choices(all_indices, all_keep, self.first,
                                       self.first + self.num_local_experts, self.num_experts)
        self.ids, self.num_choices = ids, all_indices.numel()
        return _scale_rows(all_x.index_select(0, ids // k), ids, input_probs), counts

    def combine(self, y):
        out = y.new_zeros(self.num_choices, y.shape[1], dtype=torch.float32)
        out = out.index_copy(0, self.ids, y.float())
        return reduce_scatter_to_sequence_parallel_region(out, self.ep_group)


DISPATCHERS = {"alltoall": MoEAlltoAllTokenDispatcher, "allgather": MoEAllGatherTokenDispatcher}
