"""The process groups of a layout as one frozen object, passed to whatever communicates.

:func:`layout_groups` lists every group of a layout as global ranks (a pure function, no process
needed); :class:`ProcessGroupCollection` is what ``initialize_model_parallel`` returns: for each
kind of group, the ``torch.distributed`` group this rank belongs to, its ranks and this rank's
place in it (Megatron-Core's ``ProcessGroupCollection`` with the ranks kept beside the groups, as
torchtitan's ``ParallelDims`` keeps its mesh). Core layers, schedules, gradient reduction, the
optimizer and inference take the groups they use from it as arguments; nothing below the
builders looks a group up in the registry (:mod:`megatron.core.parallel_state`).

Group convention of ``megatron.core``: a function that communicates takes a
``torch.distributed.ProcessGroup``, or None for *a world of one* (a single process without
``torch.distributed``; every collective is then the identity). None never means "the registry's
group" nor torch's default (world) group: :func:`group_size` and :func:`group_rank` are the one
reading of a group, used everywhere.

Rank order (Megatron-Core's ``tp-cp-dp-pp``: tensor-parallel fastest, then context-parallel,
then data-parallel, then pipeline)::

    rank = ((pp_rank * DP + dp_rank) * CP + cp_rank) * TP + tp_rank

Worked example, 8 ranks, TP=2, PP=2, DP=2 (CP=1)::

    tensor-parallel groups:   [0, 1] [2, 3] [4, 5] [6, 7]
    context-parallel groups:  [0] [1] [2] [3] [4] [5] [6] [7]
    data-parallel groups:     [0, 2] [1, 3] [4, 6] [5, 7]
    data x context groups:    [0, 2] [1, 3] [4, 6] [5, 7]    (= data-parallel at CP=1)
    pipeline groups:          [0, 4] [1, 5] [2, 6] [3, 7]
    model-parallel groups:    [0, 1, 4, 5] [2, 3, 6, 7]    (TP x PP, one per (DP, CP) rank)
    embedding groups:         [0, 4] [1, 5] [2, 6] [3, 7]  (first and last pipeline stage)

Worked example with context parallelism, 16 ranks, TP=2, CP=2, PP=2, DP=2
(``--context-parallel-size 2``)::

    tensor-parallel groups:   [0, 1] [2, 3] [4, 5] [6, 7] [8, 9] [10, 11] [12, 13] [14, 15]
    context-parallel groups:  [0, 2] [1, 3] [4, 6] [5, 7] [8, 10] [9, 11] [12, 14] [13, 15]
    data-parallel groups:     [0, 4] [1, 5] [2, 6] [3, 7] [8, 12] [9, 13] [10, 14] [11, 15]
    data x context groups:    [0, 2, 4, 6] [1, 3, 5, 7] [8, 10, 12, 14] [9, 11, 13, 15]
    pipeline groups:          [0, 8] [1, 9] [2, 10] [3, 11] [4, 12] [5, 13] [6, 14] [7, 15]
    model-parallel groups:    [0, 1, 8, 9] [2, 3, 10, 11] [4, 5, 12, 13] [6, 7, 14, 15]
    embedding groups:         the pipeline groups (first and last stage)

Ranks 0 and 2 hold the same weights (tensor rank 0 of stage 0) and the same micro-batches (data
rank 0), each its half of every sequence: attention exchanges keys and values over the
context-parallel group [0, 2]; the data loader reads by data-parallel rank (ranks 0, 2 read the
same samples, 4 and 6 the next ones); gradients are reduced, and the distributed optimizer shards,
over the data x context group [0, 2, 4, 6], whose four ranks all hold replicas of one model shard.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

# Dimensions in rank order, fastest first (Megatron-Core's "tp-cp-dp-pp").
_ORDER = ("tp", "cp", "dp", "pp")

# Kind of group -> the dimensions its members differ in.
_VARYING = {"tensor": ("tp",), "context": ("cp",), "data": ("dp",), "data_context": ("cp", "dp"),
            "pipeline": ("pp",), "model": ("tp", "pp")}

# Creation order of the groups (torch.distributed.new_group is collective over the whole world).
CREATION_ORDER = ("data", "data_context", "context", "model", "tensor", "pipeline", "embedding")


def group_size(group) -> int:
    """Number of ranks of ``group``; 1 for None (a world of one)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside ``group``; 0 for None (a world of one)."""
    return 0 if group is None else dist.get_rank(group)


def _groups_varying(sizes: Dict[str, int], varying: Tuple[str, ...]) -> List[List[int]]:
    """Every group whose members differ exactly in the ``varying`` dimensions, as sorted global
    ranks; groups enumerated with the fixed dimensions in rank order (fastest first)."""
    strides, stride = {}, 1
    for dim in _ORDER:
        strides[dim] = stride
        stride *= sizes[dim]
    fixed = [d for d in _ORDER if d not in varying]
    groups = []
    # itertools.product varies its last factor fastest: list the fixed dimensions slowest first.
    for fixed_pos in itertools.product(*(range(sizes[d]) for d in reversed(fixed))):
        base = sum(p * strides[d] for d, p in zip(reversed(fixed), fixed_pos))
        members = [base + sum(p * strides[d] for d, p in zip(varying, pos))
                   for pos in itertools.product(*(range(sizes[d]) for d in varying))]
        groups.append(sorted(members))
    return groups


def layout_groups(world_size: int, tensor_model_parallel_size: int,
                  pipeline_model_parallel_size: int, context_parallel_size: int = 1) -> dict:
    """Every group of a layout as lists of global ranks, without creating any group.

    Pure function (no process group needed), used by ``initialize_model_parallel`` and by tests
    and tools that print a layout. Rank order: see the module docstring.

    Returns:
        dict with keys ``tensor``, ``context``, ``data``, ``data_context`` (DP x CP),
        ``pipeline``, ``model`` (TP x PP), ``embedding`` (first and last rank of each pipeline
        group; the one rank at PP = 1); each a list of rank lists, in creation order.

    Raises:
        ValueError: if a size is below 1 or ``world_size`` is not divisible by TP x CP x PP.
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if min(tp, pp, cp) < 1:
        raise ValueError(f"tensor ({tp}), pipeline ({pp}) and context ({cp}) parallel sizes must "
                         f"be >= 1")
    if world_size % (tp * pp * cp) != 0:
        extra = f" x --context-parallel-size ({cp})" if cp > 1 else ""
        raise ValueError(
            f"world size ({world_size}) must be divisible by --tensor-model-parallel-size ({tp}) "
            f"x --pipeline-model-parallel-size ({pp}){extra}")
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": world_size // (tp * pp * cp)}
    groups = {kind: _groups_varying(sizes, varying) for kind, varying in _VARYING.items()}
    groups["embedding"] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in groups["pipeline"]]
    return groups


@dataclass(frozen=True)
class ParallelGroup:
    """One process group as this rank sees it.

    Attributes:
        group: the ``torch.distributed`` group; None for a world of one (no
            ``torch.distributed``), for the context-parallel group of one while CP = 1 (nothing
            communicates over it) and for a group this rank is not in (``rank`` is -1 then).
            Code that communicates checks ``size`` first: a torch collective given None would
            run over the whole world.
        ranks: the group's global ranks, in group-rank order.
        rank: this process's rank inside the group (its index in ``ranks``), -1 if not a member.
    """

    group: Optional[object]
    ranks: Tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        """Number of ranks of the group."""
        return len(self.ranks)

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    def neighbour(self, offset: int) -> int:
        """Global rank ``offset`` places after this rank in the group, wrapping around (the next
        pipeline stage for 1, the previous for -1)."""
        return self.ranks[(self.rank + offset) % self.size]

    @classmethod
    def of_one(cls, group, global_rank: int) -> "ParallelGroup":
        """A group holding only this process, global rank ``global_rank`` (``group`` None where
        no communicator exists)."""
        return cls(group, (global_rank,), 0)


@dataclass(frozen=True)
class ProcessGroupCollection:
    """Every group of this rank's layout (Megatron-Core's ``ProcessGroupCollection``).

    Attributes:
        tp: tensor-parallel group.
        pp: pipeline-parallel group (ranks in stage order).
        dp: data-parallel group (the replicas of this rank's model shard).
        cp: context-parallel group: the ranks that split each sequence (``--context-parallel-size``;
            a group of one without communicator at CP = 1).
        dp_cp: data x context-parallel group: gradients are reduced and the distributed
            optimizer shards over it (Megatron-Core's ``dp_cp``; equal to ``dp`` at CP = 1).
        model: model-parallel group (TP x PP: one full model).
        embedding: first and last pipeline stage (tied word embedding); a non-member group on
            middle stages, the rank alone at PP = 1.
        rank / world_size: this process's global rank and the world's size.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (interleaved
            schedule), None without virtual stages.
    """

    tp: ParallelGroup
    pp: ParallelGroup
    dp: ParallelGroup
    cp: ParallelGroup
    dp_cp: ParallelGroup
    model: ParallelGroup
    embedding: ParallelGroup
    rank: int = 0
    world_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None

    @classmethod
    def world_of_one(cls, virtual_pipeline_model_parallel_size: Optional[int] = None
                     ) -> "ProcessGroupCollection":
        """The groups of a single process without ``torch.distributed`` (every group None, of
        size 1): layers built with it run their collectives as the identity."""
        one = ParallelGroup.of_one(None, 0)
        return cls(tp=one, pp=one, dp=one, cp=one, dp_cp=one, model=one, embedding=one,
                   virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size)

    def is_pipeline_first_stage(self, vp_stage: Optional[int] = None) -> bool:
        """True on pipeline rank 0; given a virtual stage (model chunk) ``vp_stage``, only for
        chunk 0 there."""
        if vp_stage is not None and self.virtual_pipeline_model_parallel_size is not None \
                and vp_stage != 0:
            return False
        return self.pp.rank == 0

    def is_pipeline_last_stage(self, vp_stage: Optional[int] = None) -> bool:
        """True on the last pipeline rank; given a virtual stage ``vp_stage``, only for the last
        model chunk there."""
        vp = self.virtual_pipeline_model_parallel_size
        if vp_stage is not None and vp is not None and vp_stage != vp - 1:
            return False
        return self.pp.rank == self.pp.size - 1

    @property
    def pipeline_next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps from the last stage to the first)."""
        return self.pp.neighbour(1)

    @property
    def pipeline_prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps from the first to the last)."""
        return self.pp.neighbour(-1)

    @property
    def in_embedding_group(self) -> bool:
        """True on the first and last pipeline stage when PP > 1 (they share the word
        embedding)."""
        return self.embedding.size > 1 and self.embedding.is_member
