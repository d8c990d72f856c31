"""Small helpers of the tensor-parallel package: group resolution, divisions, splits, vocab ranges.

Group convention (docs/architecture.md): every public function takes ``group=None``; None means
the registry's tensor-parallel group (``megatron.core.parallel_state``). In a single process
without ``torch.distributed`` and without a registry, None means "no group": size 1, rank 0, and
every collective is the identity, so layers can be built and run in plain single-process code.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def resolve_tensor_parallel_group(group=None):
    """Return ``group``, or the registry's tensor-parallel group when ``group`` is None.

    Returns None (meaning a world of one) when neither ``torch.distributed`` nor the registry is
    initialized.

    Raises:
        RuntimeError: if ``torch.distributed`` is initialized but the model-parallel groups are not
            (silently using the whole world as the tensor-parallel group would be wrong).
    """
    if group is not None:
        return group
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is initialized but the model-parallel groups are not: call "
            "megatron.core.parallel_state.initialize_model_parallel(...) first, or pass group=")
    return None


def group_world_size(group) -> int:
    """Size of a resolved group (1 for None, see :func:`resolve_tensor_parallel_group`)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside a resolved group (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def tensor_parallel_size_and_rank(group=None) -> Tuple[int, int]:
    """(size, rank) of ``group`` after :func:`resolve_tensor_parallel_group`."""
    group = resolve_tensor_parallel_group(group)
    return group_world_size(group), group_rank(group)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact integer division.

    Raises:
        ValueError: naming ``what`` when ``numerator`` is not divisible by ``denominator``.
    """
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size "
                         f"({denominator}); choose sizes divisible by --tensor-model-parallel-size")
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    """Split ``tensor`` into ``num_partitions`` equal chunks along its last dimension (Megatron).

    Raises:
        ValueError: if the last dimension is not divisible by ``num_partitions``.
    """
    last = divide(tensor.size(-1), num_partitions, "last dimension")
    chunks = torch.split(tensor, last, dim=-1)
    if contiguous_split_chunks:
        return tuple(c.contiguous() for c in chunks)
    return chunks


class VocabUtility:
    """Vocabulary range ``[first, last)`` owned by a tensor-parallel rank (Megatron's helper)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> Tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size, "vocabulary size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


# Tensor-parallel parameter attributes (Megatron names) -------------------------------------

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int = 1) -> None:
    """Mark ``tensor`` as partitioned (or not) along ``dim`` over the tensor-parallel group."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the not-partitioned attributes where it has none."""
    for name, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the partition attributes of ``source`` (e.g. a model param) to ``destination``
    (e.g. its fp32 main param)."""
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, group=None) -> bool:
    """True if ``param`` is partitioned, or if this is tensor-parallel rank 0.

    Use it to count each element once across the tensor-parallel group (gradient norms,
    parameter counts): a replicated parameter is counted on rank 0 only.
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    return tensor_parallel_size_and_rank(group)[1] == 0


def partition_rows(master: torch.Tensor, dim: int, world_size: int, rank: int,
                   what: str) -> torch.Tensor:
    """This rank's contiguous slice of ``master`` along ``dim`` (a copy, contiguous)."""
    size = divide(master.size(dim), world_size, what)
    return master.narrow(dim, rank * size, size).clone()

