"""The process-group registry: tensor-, pipeline- and data-parallel groups.

This module is the one accepted global of the project: builders (the entry script, the model
provider, the training loop) read the groups from here; core layers receive the group they use as
an argument and keep it.

Rank order follows Megatron-LM: tensor-parallel ranks are contiguous, then data-parallel, then
pipeline. With ``world_size = TP * DP * PP`` the global rank is::

    rank = pp_rank * (TP * DP) + dp_rank * TP + tp_rank

Worked example, 8 ranks, TP=2, PP=2, DP=2::

    tensor-parallel groups:   [0, 1] [2, 3] [4, 5] [6, 7]
    data-parallel groups:     [0, 2] [1, 3] [4, 6] [5, 7]
    pipeline groups:          [0, 4] [1, 5] [2, 6] [3, 7]
    model-parallel groups:    [0, 1, 4, 5] [2, 3, 6, 7]    (TP x PP, one per data-parallel rank)
    embedding groups:         [0, 4] [1, 5] [2, 6] [3, 7]  (first and last pipeline stage)

Every rank creates every group in the same order (``torch.distributed.new_group`` is collective)
and keeps the ones it belongs to.
"""

from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist

_TENSOR_MODEL_PARALLEL_GROUP = None
_PIPELINE_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None
_MODEL_PARALLEL_GROUP = None
_EMBEDDING_GROUP = None

_TENSOR_MODEL_PARALLEL_RANKS: Optional[List[int]] = None
_PIPELINE_MODEL_PARALLEL_RANKS: Optional[List[int]] = None
_DATA_PARALLEL_RANKS: Optional[List[int]] = None
_MODEL_PARALLEL_RANKS: Optional[List[int]] = None
_EMBEDDING_RANKS: Optional[List[int]] = None

_VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE: Optional[int] = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK: Optional[int] = None


def layout_groups(world_size: int, tensor_model_parallel_size: int,
                  pipeline_model_parallel_size: int) -> dict:
    """Return every group of a layout as lists of global ranks, without creating any group.

    Pure function (no process group needed), used by :func:`initialize_model_parallel` and by
    tests and tools that want to print a layout.

    Returns:
        dict with keys ``tensor``, ``data``, ``pipeline``, ``model``, ``embedding``; each a list of
        rank lists, in creation order.

    Raises:
        ValueError: if ``world_size`` is not divisible by TP x PP.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor ({tp}) and pipeline ({pp}) model-parallel sizes must be >= 1")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size ({world_size}) must be divisible by --tensor-model-parallel-size ({tp}) "
            f"x --pipeline-model-parallel-size ({pp})")
    dp = world_size // (tp * pp)
    ranks_per_stage = tp * dp

    data = []
    for stage in range(pp):
        start = stage * ranks_per_stage
        for j in range(tp):
            data.append(list(range(start + j, start + ranks_per_stage, tp)))
    tensor = [list(range(i * tp, (i + 1) * tp)) for i in range(world_size // tp)]
    pipeline = [list(range(i, world_size, ranks_per_stage)) for i in range(ranks_per_stage)]
    model = []
    for d in range(dp):
        model.append(sorted(r for stage in range(pp) for r in
                            range(stage * ranks_per_stage + d * tp, stage * ranks_per_stage + (d + 1) * tp)))
    embedding = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pipeline]
    return {"tensor": tensor, "data": data, "pipeline": pipeline, "model": model,
            "embedding": embedding}


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              timeout=None) -> None:
    """Create the tensor-, pipeline-, data-, model-parallel and embedding groups.

    ``torch.distributed`` must already be initialized (gloo on CPU, NCCL on CUDA). Collective:
    every rank must call it with the same arguments. ``timeout`` (a ``datetime.timedelta``, from
    ``--distributed-timeout-minutes``) bounds every collective of the new groups; None keeps
    torch's default (new groups do not inherit the world group's timeout).

    Raises:
        RuntimeError: if torch.distributed is not initialized or groups already exist.
        ValueError: if the world size is not divisible by TP x PP.
    """
    global _TENSOR_MODEL_PARALLEL_GROUP, _PIPELINE_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    global _MODEL_PARALLEL_GROUP, _EMBEDDING_GROUP
    global _TENSOR_MODEL_PARALLEL_RANKS, _PIPELINE_MODEL_PARALLEL_RANKS, _DATA_PARALLEL_RANKS
    global _MODEL_PARALLEL_RANKS, _EMBEDDING_RANKS
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE, _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before initialize_model_parallel")
    if model_parallel_is_initialized():
        raise RuntimeError("model-parallel groups are already initialized; call destroy_model_parallel first")
    rank = dist.get_rank()
    groups = layout_groups(dist.get_world_size(), tensor_model_parallel_size,
                           pipeline_model_parallel_size)

    def create(kind):
        # Middle pipeline stages belong to no embedding group: no group, no ranks.
        mine = (None, [])
        for ranks in groups[kind]:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = (group, ranks)
        return mine

    # Creation order is fixed: new_group is collective over the whole world.
    _DATA_PARALLEL_GROUP, _DATA_PARALLEL_RANKS = create("data")
    _MODEL_PARALLEL_GROUP, _MODEL_PARALLEL_RANKS = create("model")
    _TENSOR_MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_RANKS = create("tensor")
    _PIPELINE_MODEL_PARALLEL_GROUP, _PIPELINE_MODEL_PARALLEL_RANKS = create("pipeline")
    _EMBEDDING_GROUP, _EMBEDDING_RANKS = create("embedding")

    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE = virtual_pipeline_model_parallel_size
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0


def model_parallel_is_initialized() -> bool:
    """True once :func:`initialize_model_parallel` has run (and not been torn down)."""
    return _TENSOR_MODEL_PARALLEL_GROUP is not None


def destroy_model_parallel() -> None:
    """Forget every group (teardown; the process groups themselves die with the default group)."""
    global _TENSOR_MODEL_PARALLEL_GROUP, _PIPELINE_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    global _MODEL_PARALLEL_GROUP, _EMBEDDING_GROUP
    global _TENSOR_MODEL_PARALLEL_RANKS, _PIPELINE_MODEL_PARALLEL_RANKS, _DATA_PARALLEL_RANKS
    global _MODEL_PARALLEL_RANKS, _EMBEDDING_RANKS
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE, _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _TENSOR_MODEL_PARALLEL_GROUP = _PIPELINE_MODEL_PARALLEL_GROUP = _DATA_PARALLEL_GROUP = None
    _MODEL_PARALLEL_GROUP = _EMBEDDING_GROUP = None
    _TENSOR_MODEL_PARALLEL_RANKS = _PIPELINE_MODEL_PARALLEL_RANKS = _DATA_PARALLEL_RANKS = None
    _MODEL_PARALLEL_RANKS = _EMBEDDING_RANKS = None
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE = _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None


def _require(group):
    if group is None:
        raise RuntimeError("model-parallel groups are not initialized; call initialize_model_parallel first")
    return group


# Groups -------------------------------------------------------------------------------------

def get_tensor_model_parallel_group():
    return _require(_TENSOR_MODEL_PARALLEL_GROUP)


def get_pipeline_model_parallel_group():
    return _require(_PIPELINE_MODEL_PARALLEL_GROUP)


def get_data_parallel_group():
    return _require(_DATA_PARALLEL_GROUP)


def get_model_parallel_group():
    return _require(_MODEL_PARALLEL_GROUP)


def get_embedding_group():
    return _require(_EMBEDDING_GROUP)


# Sizes and ranks ------------------------------------------------------------------------------

def get_tensor_model_parallel_world_size() -> int:
    return len(_require(_TENSOR_MODEL_PARALLEL_RANKS))


def get_tensor_model_parallel_rank() -> int:
    return _require(_TENSOR_MODEL_PARALLEL_RANKS).index(dist.get_rank())


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's tensor-parallel group."""
    return _require(_TENSOR_MODEL_PARALLEL_RANKS)[0]


def get_tensor_model_parallel_ranks() -> List[int]:
    return list(_require(_TENSOR_MODEL_PARALLEL_RANKS))


def get_pipeline_model_parallel_world_size() -> int:
    return len(_require(_PIPELINE_MODEL_PARALLEL_RANKS))


def get_pipeline_model_parallel_rank() -> int:
    return _require(_PIPELINE_MODEL_PARALLEL_RANKS).index(dist.get_rank())


def get_pipeline_model_parallel_ranks() -> List[int]:
    return list(_require(_PIPELINE_MODEL_PARALLEL_RANKS))


def get_data_parallel_world_size() -> int:
    return len(_require(_DATA_PARALLEL_RANKS))


def get_data_parallel_rank() -> int:
    return _require(_DATA_PARALLEL_RANKS).index(dist.get_rank())


def get_data_parallel_ranks() -> List[int]:
    return list(_require(_DATA_PARALLEL_RANKS))


def get_model_parallel_ranks() -> List[int]:
    return list(_require(_MODEL_PARALLEL_RANKS))


def get_embedding_ranks() -> List[int]:
    return list(_require(_EMBEDDING_RANKS))


def is_rank_in_embedding_group() -> bool:
    """True on the first and last pipeline stage when PP > 1 (they share the word embedding)."""
    ranks = _require(_EMBEDDING_RANKS)
    return len(ranks) > 1 and dist.get_rank() in ranks


# Pipeline position ----------------------------------------------------------------------------

def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on pipeline rank 0 (and, with virtual stages, on the first model chunk)."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE is not None:
        if _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the last pipeline rank (and, with virtual stages, on the last model chunk)."""
    if not ignore_virtual and _VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE is not None:
        if _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK != _VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next pipeline stage (wraps around from the last to the first)."""
    ranks = _require(_PIPELINE_MODEL_PARALLEL_RANKS)
    return ranks[(ranks.index(dist.get_rank()) + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous pipeline stage (wraps around from the first to the last)."""
    ranks = _require(_PIPELINE_MODEL_PARALLEL_RANKS)
    return ranks[(ranks.index(dist.get_rank()) - 1) % len(ranks)]
