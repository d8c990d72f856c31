"""Small helpers of the tensor-parallel package: group size and rank, divisions, splits, vocab
ranges.

Group convention (:mod:`megatron.core.process_groups`): every function that communicates takes the
tensor-parallel group as an argument, a ``torch.distributed`` group or None for a world of one
(size 1, rank 0, every collective the identity), so layers can be built and run in plain
single-process code. Nothing here looks a group up in the registry.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from megatron.core.process_groups import group_rank, group_size

def tensor_parallel_size_and_rank(group) -> Tuple[int, int]:
    """(size, rank) of the tensor-parallel ``group`` (``(1, 0)`` for None)."""
    return group_size(group), group_rank(group)


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


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_group) -> bool:
    """True if ``param`` is partitioned, or if this is rank 0 of the tensor-parallel group
    ``tp_group`` (None: a world of one).

    Use it to count each element once across the tensor-parallel group (gradient norms,
    parameter counts): a replicated parameter is counted on rank 0 only.
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    return group_rank(tp_group) == 0


def partition_rows(master: torch.Tensor, dim: int, world_size: int, rank: int,
                   what: str) -> torch.Tensor:
    """This rank's contiguous slice of ``master`` along ``dim`` (a copy, contiguous)."""
    size = divide(master.size(dim), world_size, what)
    return master.narrow(dim, rank * size, size).clone()

