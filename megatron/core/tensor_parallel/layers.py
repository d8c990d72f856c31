"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Shapes: s = sequence, b = micro-batch, h/in/out = feature widths, v = vocabulary, TP = tensor-
parallel size. Source: Shoeybi et al., "Megatron-LM" (arXiv:1909.08053) section 3, and, for
``sequence_parallel``, Korthikanti et al. (arXiv:2205.05198) section 4.2.2; names and arguments
follow Megatron-LM's ``megatron/core/tensor_parallel/layers.py``.

Layout-independent initialisation (docs/architecture.md): each layer builds the full master
weight in fp32 on CPU, calls ``init_method(master_weight)`` (drawing from the default CPU
generator, which the caller seeds), keeps its own partition and casts it to ``params_dtype`` on
``device``. So the same seed gives the same full weight at every TP size: the TP=2 layer is the
TP=1 layer split.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel.grad_accumulation import (accumulator_of,
                                                           embedding_weight_grad,
                                                           linear_weight_grad)
from megatron.core.tensor_parallel.mappings import (
    all_gather_first_dim, copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    reduce_scatter_first_dim, reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region)
from megatron.core.process_groups import group_rank, group_size
from megatron.core.tensor_parallel.utils import (
    VocabUtility, divide, partition_rows, param_is_not_tensor_parallel_duplicate,
    set_tensor_model_parallel_attributes)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "TensorParallelGroupMixin", "param_is_not_tensor_parallel_duplicate",
           "linear_with_grad_accumulation"]


def _master_partition(full_shape, partition_dim: int, init_method: Callable, world: int, rank: int,
                      params_dtype: torch.dtype, device, what: str) -> nn.Parameter:
    """Initialise the full fp32 master weight on CPU, keep this rank's slice along
    ``partition_dim``, cast and move it. On the meta device nothing is drawn or allocated (the
    weights a checkpoint will fill; :func:`megatron.model.materialize.materialize`)."""
    on_meta = device is not None and torch.device(device).type == "meta"
    master = torch.empty(full_shape, dtype=torch.float32, device="meta" if on_meta else "cpu")
    init_method(master)
    part = partition_rows(master, partition_dim, world, rank, what)
    del master
    param = nn.Parameter(part.to(dtype=params_dtype, device=device))
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=partition_dim, stride=1)
    return param


class TensorParallelGroupMixin:
    """Holds a module's tensor-parallel group as ``tp_group``, out of ``copy.deepcopy`` (a
    ProcessGroup cannot be copied; a copied module shares its group)."""

    def _set_group(self, group) -> None:
        self._group_ref = _SharedRef(group)

    @property
    def tp_group(self):
        """The tensor-parallel group the layer communicates over (None: a world of one)."""
        return self._group_ref.value


class _SharedRef:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


def _zeros_param(size: int, params_dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(size, dtype=params_dtype, device=device))


class _LinearWithGradAccumulation(torch.autograd.Function):
    """``y = x W^T + b``, optionally all-gathering ``x`` along the sequence first, with the weight
    gradient accumulated into ``W.main_grad`` (gradient-accumulation fusion).

    Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` (without the asynchronous
    input-gradient all-reduce: ``copy_to_tensor_model_parallel_region`` does it before). With
    ``sequence_parallel`` only the local ``x`` shard is saved and the gathered input is rebuilt in
    backward (a second all-gather), so the saved activation is ``[s/TP, b, in]``; backward
    reduce-scatters the input gradient.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias, gradient_accumulation_fusion, sequence_parallel, group):
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.use_bias = bias is not None
        ctx.save_for_backward(input_, weight)
        total_input = all_gather_first_dim(input_, group) if sequence_parallel else input_
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
            if ctx.sequence_parallel:
                grad_input = reduce_scatter_first_dim(grad_input, ctx.group)
        if ctx.needs_input_grad[1] or (ctx.use_bias and ctx.needs_input_grad[2]):
            grad_2d = grad_output.reshape(-1, grad_output.size(-1))
            if ctx.needs_input_grad[1]:
                total_input = (all_gather_first_dim(input_, ctx.group) if ctx.sequence_parallel
                               else input_)
                grad_weight = linear_weight_grad(weight, grad_2d,
                                                 total_input.reshape(-1, total_input.size(-1)),
                                                 ctx.gradient_accumulation_fusion,
                                                 accumulator_of(ctx, 1))
            if ctx.use_bias and ctx.needs_input_grad[2]:
                grad_bias = grad_2d.sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None, None


def linear_with_grad_accumulation(input_: torch.Tensor, weight: torch.Tensor,
                                  bias: Optional[torch.Tensor] = None, *,
                                  gradient_accumulation_fusion: bool = True,
                                  sequence_parallel: bool = False, tp_group) -> torch.Tensor:
    """``F.linear(x, W, b)`` whose weight gradient goes straight into ``W.main_grad`` when the
    weight has one (see :mod:`megatron.core.tensor_parallel.grad_accumulation`).

    Args:
        input_: ``[..., in]`` (``[s/TP, b, in]`` with ``sequence_parallel``).
        weight: ``[out, in]``; bias: ``[out]`` or None.
        gradient_accumulation_fusion: accumulate ``dY^T X`` into ``weight.main_grad`` in backward.
        sequence_parallel: all-gather ``input_`` along its first dim over the tensor-parallel
            group in forward (only the local shard is saved); reduce-scatter the input gradient in
            backward. Ignored in a group of one.
        tp_group: the tensor-parallel group of ``sequence_parallel`` (None: a world of one).

    Returns:
        ``[..., out]`` (``[s, b, out]`` with ``sequence_parallel``).
    """
    sequence_parallel = sequence_parallel and group_size(tp_group) > 1
    return _LinearWithGradAccumulation.apply(input_, weight, bias, gradient_accumulation_fusion,
                                             sequence_parallel, tp_group)


class ColumnParallelLinear(TensorParallelGroupMixin, nn.Module):
    """``Y = X A + b`` with ``A`` partitioned along its output columns: ``A = [A_1, ..., A_TP]``.

    Args:
        input_size: in, the full input width.
        output_size: out, the full output width (divisible by TP).
        init_method: called on the full fp32 master weight ``[out, in]`` (may reorder rows).
        bias: add a bias (partitioned like the output; initialised to zero).
        gather_output: all-gather the output so every rank gets ``[s, b, out]``.
        skip_bias_add: return the bias instead of adding it (for fusion by the caller).
        sequence_parallel: the input is ``[s/TP, b, in]``; it is all-gathered along the sequence
            in forward and the input gradient reduce-scattered in backward.
        params_dtype: dtype of the weight and bias.
        device: device of the weight and bias (default CPU).
        tp_group: the tensor-parallel group (a ``torch.distributed`` group, or None for a world
            of one; required: a layer never looks its group up).
        gradient_accumulation_fusion: accumulate the weight gradient straight into
            ``weight.main_grad`` when it has one (``--no-gradient-accumulation-fusion`` turns it
            off; see :mod:`megatron.core.tensor_parallel.grad_accumulation`).

    Weight ``[out/TP, in]``; ``forward(x [s, b, in]) -> (out [s, b, out/TP], bias or None)``
    (``[s, b, out]`` with ``gather_output``); any leading dims work without sequence parallelism.

    Raises:
        ValueError: if ``output_size`` is not divisible by TP, or if ``gather_output`` is combined
            with ``sequence_parallel``.
    """

    def __init__(self, input_size: int, output_size: int, *, init_method: Callable, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 device=None, tp_group, gradient_accumulation_fusion: bool = True):
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with "
                             "sequence_parallel=True (Megatron forbids it too)")
        self._set_group(tp_group)
        world, rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, world, "ColumnParallelLinear output_size")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel and world > 1
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.weight = _master_partition((output_size, input_size), 0, init_method, world, rank,
                                        params_dtype, device, "ColumnParallelLinear output_size")
        if bias:
            self.bias = _zeros_param(self.output_size_per_partition, params_dtype, device)
            set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=1)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        bias = None if self.skip_bias_add else self.bias
        if not self.sequence_parallel:
            input_ = copy_to_tensor_model_parallel_region(input_, self.tp_group)
        output = linear_with_grad_accumulation(
            input_, self.weight, bias, sequence_parallel=self.sequence_parallel, tp_group=self.tp_group,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, "
                f"out_per_partition={self.output_size_per_partition}, bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(TensorParallelGroupMixin, nn.Module):
    """``Y = X A + b`` with ``A`` partitioned along its input rows and ``X`` along its last dim.

    Args:
        input_size: in, the full input width (divisible by TP).
        output_size: out, the full output width.
        init_method: called on the full fp32 master weight ``[out, in]``.
        bias: add a bias (replicated, added after the reduction; initialised to zero).
        input_is_parallel: the input is already split ``[s, b, in/TP]`` (else it is scattered).
        skip_bias_add: return the bias instead of adding it.
        sequence_parallel: reduce-scatter the output along the sequence (``[s/TP, b, out]``)
            instead of all-reducing it; the bias then carries ``sequence_parallel=True`` (its
            gradient must be all-reduced over the tensor-parallel group, as for norm weights).
        params_dtype, device, tp_group, gradient_accumulation_fusion: as :class:`ColumnParallelLinear`.

    Weight ``[out, in/TP]``; ``forward(x [s, b, in/TP]) -> (out [s, b, out], bias or None)``
    (``[s/TP, b, out]`` with ``sequence_parallel``).

    Raises:
        ValueError: if ``input_size`` is not divisible by TP, or ``sequence_parallel`` is used
            without ``input_is_parallel``.
    """

    def __init__(self, input_size: int, output_size: int, *, init_method: Callable, bias: bool = True,
                 input_is_parallel: bool = True, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 device=None, tp_group, gradient_accumulation_fusion: bool = True):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True")
        self._set_group(tp_group)
        world, rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, world, "RowParallelLinear input_size")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel and world > 1
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.weight = _master_partition((output_size, input_size), 1, init_method, world, rank,
                                        params_dtype, device, "RowParallelLinear input_size")
        if bias:
            self.bias = _zeros_param(output_size, params_dtype, device)
            set_tensor_model_parallel_attributes(self.bias, is_parallel=False, dim=-1, stride=1)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        output_parallel = linear_with_grad_accumulation(
            input_, self.weight, gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            tp_group=self.tp_group)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, "
                f"in_per_partition={self.input_size_per_partition}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")


class _Embedding(torch.autograd.Function):
    """``W[ids]`` (``F.embedding``) whose backward adds rows into ``W.main_grad`` when fused."""

    @staticmethod
    def forward(ctx, ids, weight, gradient_accumulation_fusion):
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        ids, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = embedding_weight_grad(weight, ids.reshape(-1),
                                                grad_output.reshape(-1, grad_output.size(-1)),
                                                ctx.gradient_accumulation_fusion,
                                                accumulator_of(ctx, 1))
        return None, grad_weight, None


class VocabParallelEmbedding(TensorParallelGroupMixin, nn.Module):
    """Embedding table partitioned along the vocabulary: rank r holds rows
    ``[r * v/TP, (r+1) * v/TP)``.

    Token ids outside the rank's range look up zeros; the all-reduce over the tensor-parallel
    group (forward; identity backward) assembles the full embedding. With
    ``reduce_scatter_embeddings`` (sequence parallelism, as Megatron-Core) the partial sums are
    instead reduce-scattered along the sequence (forward; all-gather in backward), which costs
    half the all-reduce's traffic and returns this rank's chunk, sequence-first.

    Args:
        num_embeddings: v, the padded vocabulary size (divisible by TP).
        embedding_dim: h.
        init_method: called on the full fp32 master weight ``[v, h]``.
        params_dtype, device, tp_group, gradient_accumulation_fusion: as :class:`ColumnParallelLinear`
            (the embedding's backward then adds its rows into ``main_grad`` with ``index_add_``).
        reduce_scatter_embeddings: return ``[s/TP, b, h]`` (see above); ids must be ``[b, s]``
            with s divisible by TP.

    Weight ``[v/TP, h]``; ``forward(ids [b, s] int64) -> [b, s, h]`` (any id shape works), or
    ``[s/TP, b, h]`` with ``reduce_scatter_embeddings`` at TP > 1.

    Raises:
        ValueError: if ``num_embeddings`` is not divisible by TP.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable,
                 params_dtype: torch.dtype = torch.float32, device=None, tp_group,
                 reduce_scatter_embeddings: bool = False, gradient_accumulation_fusion: bool = True):
        super().__init__()
        self._set_group(tp_group)
        world, rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and world > 1
        self.tensor_model_parallel_size = world
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        per_partition = divide(num_embeddings, world, "VocabParallelEmbedding num_embeddings (pad the "
                               "vocabulary with --make-vocab-size-divisible-by)")
        self.vocab_start_index, self.vocab_end_index = \
            VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _master_partition((num_embeddings, embedding_dim), 0, init_method, world, rank,
                                        params_dtype, device, "VocabParallelEmbedding num_embeddings")

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tensor_model_parallel_size == 1:
            return _Embedding.apply(input_, self.weight, self.gradient_accumulation_fusion)
        input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        masked_input = (input_ - self.vocab_start_index).masked_fill(input_mask, 0)
        output_parallel = _Embedding.apply(masked_input, self.weight, self.gradient_accumulation_fusion)
        output_parallel = output_parallel.masked_fill(input_mask.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"rows=[{self.vocab_start_index}, {self.vocab_end_index})")
