"""The f/g autograd mappings of tensor and sequence parallelism.

Source: Shoeybi et al., "Megatron-LM" (arXiv:1909.08053), section 3, operators f and g; Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198),
section 4.2.2, operators g and g-bar of sequence parallelism. Names follow Megatron-LM's
``megatron/core/tensor_parallel/mappings.py``.

Every collective of tensor parallelism lives in this file. Each public function takes the
tensor-parallel ``group`` it communicates over (a ``torch.distributed`` group, or None for a world
of one; see :mod:`megatron.core.process_groups`) and is the identity in a group of one. Tensor-parallel dimensions: the *last* dimension for the
tensor-parallel region (hidden or vocabulary partitions), the *first* dimension (sequence, of
``[s, b, h]`` activations) for the sequence-parallel region.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.process_groups import group_rank, group_size
from megatron.core.tensor_parallel.utils import divide

# torch >= 2.x renamed the flat-tensor collectives; both names take (output, input, ..., group=).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Plain collectives (no autograd) --------------------------------------------------------------

def _all_reduce(x: torch.Tensor, group, op=None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    # A copy, so that the caller's tensor is never modified behind autograd's back.
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return out


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    size = divide(x.size(-1), world, "last dimension")
    return x.narrow(-1, group_rank(group) * size, size).contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    # all-gather concatenates along dim 0; gather the last dim moved to the front, then move back.
    moved = x.movedim(-1, 0).contiguous()
    out = torch.empty((world * moved.size(0),) + tuple(moved.shape[1:]), dtype=x.dtype,
                      device=x.device)
    _all_gather_flat(out, moved, group=group)
    return out.movedim(0, -1).contiguous()


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    size = divide(x.size(0), world, "sequence length (first dimension)")
    return x.narrow(0, group_rank(group) * size, size).contiguous()


def _gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(out, x, group=group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    size = divide(x.size(0), world, "sequence length (first dimension)")
    x = x.contiguous()
    out = torch.empty((size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, x, group=group)
    return out


# Autograd functions: Megatron's f and g ------------------------------------------------------

def _mapping(name: str, forward_fn, backward_fn, doc: str):
    """An autograd function applying ``forward_fn(x, group)`` forward, ``backward_fn(g, group)``
    backward. The classes keep Megatron's names so that tracebacks read like Megatron's."""

    def forward(ctx, input_, group):
        ctx.group = group
        return forward_fn(input_, group)

    def backward(ctx, grad_output):
        return backward_fn(grad_output, ctx.group), None

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward), "__doc__": doc})


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    # A view, so that autograd records a new node without copying.
    return x.view_as(x)


_CopyToModelParallelRegion = _mapping(
    "_CopyToModelParallelRegion", _identity, _all_reduce,
    "f: forward identity; backward all-reduce over the tensor-parallel group.")
_ReduceFromModelParallelRegion = _mapping(
    "_ReduceFromModelParallelRegion", _all_reduce, _identity,
    "g: forward all-reduce over the tensor-parallel group; backward identity.")
_ScatterToModelParallelRegion = _mapping(
    "_ScatterToModelParallelRegion", _split_last_dim, _gather_last_dim,
    "Forward: keep this rank's chunk of the last dim; backward: all-gather the last dim.")
_GatherFromModelParallelRegion = _mapping(
    "_GatherFromModelParallelRegion", _gather_last_dim, _split_last_dim,
    "Forward: all-gather the last dim; backward: keep this rank's chunk.")
_ScatterToSequenceParallelRegion = _mapping(
    "_ScatterToSequenceParallelRegion", _split_first_dim, _gather_first_dim,
    "Forward: keep this rank's chunk of the first (sequence) dim; backward: all-gather it.")
_ReduceScatterToSequenceParallelRegion = _mapping(
    "_ReduceScatterToSequenceParallelRegion", _reduce_scatter_first_dim, _gather_first_dim,
    "g-bar of sequence parallelism: forward reduce-scatter the first dim; backward all-gather.")


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """g of sequence parallelism: forward all-gather the first dim; backward reduce-scatter
    (the consumer is tensor-parallel, each rank holds a partial gradient) or split (it is not)."""

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first_dim(grad_output, ctx.group), None, None
        return _split_first_dim(grad_output, ctx.group), None, None


# Public API -----------------------------------------------------------------------------------

def _apply(function, input_: torch.Tensor, group, *extra) -> torch.Tensor:
    if group_size(group) == 1:
        return input_  # the identity: no autograd node, no Python call in backward
    return function.apply(input_, group, *extra)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """f. Forward: identity; backward: all-reduce (sum) over the tensor-parallel group.

    Any shape and dtype; returns the same shape.
    """
    return _apply(_CopyToModelParallelRegion, input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """g. Forward: all-reduce (sum) over the tensor-parallel group; backward: identity.

    Any shape and dtype; returns a new tensor of the same shape (the input is not modified).
    """
    return _apply(_ReduceFromModelParallelRegion, input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim (``[..., n] -> [..., n/TP]``); backward:
    all-gather the last dim over the tensor-parallel group.

    Raises:
        ValueError: if the last dimension is not divisible by TP.
    """
    return _apply(_ScatterToModelParallelRegion, input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather the last dim over the tensor-parallel group (``[..., n/TP] ->
    [..., n]``, rank order); backward: keep this rank's chunk."""
    return _apply(_GatherFromModelParallelRegion, input_, group)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of the first dim (``[s, b, h] -> [s/TP, b, h]``);
    backward: all-gather the first dim over the tensor-parallel group.

    Raises:
        ValueError: if the first dimension is not divisible by TP.
    """
    return _apply(_ScatterToSequenceParallelRegion, input_, group)


def gather_from_sequence_parallel_region(input_: torch.Tensor, group,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Forward: all-gather the first dim over the tensor-parallel group (``[s/TP, b, h] ->
    [s, b, h]``); backward: reduce-scatter the first dim when ``tensor_parallel_output_grad``
    (the consumer is a tensor-parallel layer, each rank holds a partial gradient), otherwise keep
    this rank's chunk (the consumer is replicated, gradients are already equal)."""
    return _apply(_GatherFromSequenceParallelRegion, input_, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group) -> torch.Tensor:
    """Forward: reduce-scatter (sum) the first dim over the tensor-parallel group (``[s, b, h] ->
    [s/TP, b, h]``); backward: all-gather the first dim.

    Raises:
        ValueError: if the first dimension is not divisible by TP.
    """
    return _apply(_ReduceScatterToSequenceParallelRegion, input_, group)


def all_gather_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """All-gather the first dim without autograd (used inside other autograd functions)."""
    return _gather_first_dim(input_, group)


def all_gather_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """All-gather the last dim without autograd (``[..., n/TP] -> [..., n]``, rank order; used by
    inference to assemble the vocabulary partitions of the logits)."""
    return _gather_last_dim(input_, group)


def reduce_scatter_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatter (sum) the first dim without autograd (used inside other autograd functions)."""
    return _reduce_scatter_first_dim(input_, group)


def all_reduce(input_: torch.Tensor, group, op=None) -> torch.Tensor:
    """All-reduce without autograd, out of place (used by cross entropy; ``op`` default SUM)."""
    return _all_reduce(input_, group, op)
