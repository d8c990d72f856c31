"""The process-group registry: the groups of this process, built once by
:func:`initialize_model_parallel`.

This module is the one accepted global of the project, read at the edges only: the entry script,
the builders of the training program, tools and tests. What it returns, a frozen
:class:`~megatron.core.process_groups.ProcessGroupCollection`, is passed down from there: core
layers, schedules, gradient reduction, the optimizer and inference take the groups they use as
arguments and never look them up here.

Rank order and the worked examples (8 ranks TP=2 PP=2 DP=2; 16 ranks with context parallelism,
TP=2 CP=2 PP=2 DP=2, its groups ``cp`` and ``dp_cp``): :mod:`megatron.core.process_groups`. Every rank creates
every group in the same order (``torch.distributed.new_group`` is collective) and keeps the ones
it belongs to; kinds with the same ranks share one communicator, and the context-parallel group of
one (CP = 1) has none (``group`` None: nothing communicates over it).
"""

from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist

from megatron.core.process_groups import (CREATION_ORDER, EXPERT_FIELDS, ParallelGroup,
                                          ProcessGroupCollection, layout_groups)

__all__ = ["initialize_model_parallel", "get_process_groups", "model_parallel_is_initialized",
           "destroy_model_parallel", "layout_groups"]

_GROUPS: Optional[ProcessGroupCollection] = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              timeout=None, context_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1,
                              expert_tensor_parallel_size: Optional[int] = None
                              ) -> ProcessGroupCollection:
    """Create every group of the layout and return this rank's
    :class:`~megatron.core.process_groups.ProcessGroupCollection` (also kept by the registry).

    ``torch.distributed`` must already be initialized (gloo on CPU, NCCL on CUDA). Collective:
    every rank must call it with the same arguments. ``timeout`` (a ``datetime.timedelta``, from
    ``--distributed-timeout-minutes``) bounds every collective of the new groups; None keeps
    torch's default (new groups do not inherit the world group's timeout).
    ``expert_model_parallel_size`` (EP) and ``expert_tensor_parallel_size`` (expert-TP, None:
    TP) lay out the expert grid (the collection's ``ep``, ``expt_tp``, ``expt_dp``, ``tp_ep``,
    ``tp_ep_pp``; :mod:`megatron.core.process_groups`).

    Raises:
        RuntimeError: if torch.distributed is not initialized or groups already exist.
        ValueError: if the world size is not divisible by TP x CP x PP, or EP x expert-TP does
            not divide TP x CP x DP.
    """
    global _GROUPS
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before initialize_model_parallel")
    if _GROUPS is not None:
        raise RuntimeError("model-parallel groups are already initialized; call "
                           "destroy_model_parallel first")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout = layout_groups(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                           context_parallel_size, expert_model_parallel_size,
                           expert_tensor_parallel_size)
    mine, made = {}, {}
    for kind in CREATION_ORDER:
        # Middle pipeline stages belong to no embedding group: no group, no ranks, rank -1.
        mine[kind] = ParallelGroup(None, (), -1)
        if len(layout[kind][0]) == 1 and (kind in ("context", "tensor_context")
                                          or kind in EXPERT_FIELDS.values()):
            # Context, tensor x context or expert group of one (CP = 1, EP = 1, expert-TP = 1):
            # nothing communicates over it, no communicator is made.
            mine[kind] = ParallelGroup.of_one(None, rank)
            continue
        for ranks in layout[kind]:
            # A kind with the same ranks as an earlier one (DP x CP = DP at CP = 1, model = TP at
            # PP = 1, ...) shares its communicator: fewer groups, the same collectives.
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[kind] = ParallelGroup(made[key], key, ranks.index(rank))
    _GROUPS = ProcessGroupCollection(
        tp=mine["tensor"], pp=mine["pipeline"], dp=mine["data"], cp=mine["context"],
        dp_cp=mine["data_context"], model=mine["model"], embedding=mine["embedding"],
        tp_cp=mine["tensor_context"], rank=rank,
        world_size=world_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        **{name: mine[kind] for name, kind in EXPERT_FIELDS.items()})
    return _GROUPS


def get_process_groups() -> ProcessGroupCollection:
    """The collection :func:`initialize_model_parallel` built.

    Raises:
        RuntimeError: before :func:`initialize_model_parallel`.
    """
    if _GROUPS is None:
        raise RuntimeError("model-parallel groups are not initialized; call "
                           "initialize_model_parallel first")
    return _GROUPS


def model_parallel_is_initialized() -> bool:
    """True once :func:`initialize_model_parallel` has run (and not been torn down)."""
    return _GROUPS is not None


def destroy_model_parallel() -> None:
    """Forget every group (teardown; the process groups themselves die with the default group)."""
    global _GROUPS
    _GROUPS = None


# Megatron-LM's getters, for the edges (tools, tests): each reads the collection. ---------------

def get_tensor_model_parallel_group():
    return get_process_groups().tp.group


def get_pipeline_model_parallel_group():
    return get_process_groups().pp.group


def get_data_parallel_group():
    return get_process_groups().dp.group


def get_model_parallel_group():
    return get_process_groups().model.group


def get_embedding_group():
    return get_process_groups().embedding.group


def get_expert_model_parallel_group():
    return get_process_groups().ep.group


def get_expert_data_parallel_group():
    return get_process_groups().expt_dp.group


def get_expert_model_parallel_world_size() -> int:
    return get_process_groups().ep.size


def get_expert_model_parallel_rank() -> int:
    return get_process_groups().ep.rank


def get_tensor_model_parallel_world_size() -> int:
    return get_process_groups().tp.size


def get_tensor_model_parallel_rank() -> int:
    return get_process_groups().tp.rank


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's tensor-parallel group."""
    return get_process_groups().tp.ranks[0]


def get_pipeline_model_parallel_world_size() -> int:
    return get_process_groups().pp.size


def get_pipeline_model_parallel_rank() -> int:
    return get_process_groups().pp.rank


def get_pipeline_model_parallel_ranks() -> List[int]:
    return list(get_process_groups().pp.ranks)


def get_data_parallel_world_size() -> int:
    return get_process_groups().dp.size


def get_data_parallel_rank() -> int:
    return get_process_groups().dp.rank


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return get_process_groups().virtual_pipeline_model_parallel_size


def is_pipeline_first_stage(vp_stage: Optional[int] = None) -> bool:
    """See :meth:`ProcessGroupCollection.is_pipeline_first_stage`."""
    return get_process_groups().is_pipeline_first_stage(vp_stage)


def is_pipeline_last_stage(vp_stage: Optional[int] = None) -> bool:
    """See :meth:`ProcessGroupCollection.is_pipeline_last_stage`."""
    return get_process_groups().is_pipeline_last_stage(vp_stage)


def get_pipeline_model_parallel_next_rank() -> int:
    return get_process_groups().pipeline_next_rank


def get_pipeline_model_parallel_prev_rank() -> int:
    return get_process_groups().pipeline_prev_rank
