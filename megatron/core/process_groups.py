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

The expert grid: a second decomposition of the same world (Megatron-Core's)
-------------------------------------------------------------------------
Expert parameters (``--expert-model-parallel-size`` EP, ``--expert-tensor-parallel-size``
expert-TP, default TP) are laid out over the same ranks in a second order, Megatron-Core's
``tp-ep-dp-pp`` (expert-TP fastest, then EP, then expert-DP, then PP; no CP: the ranks that
attention splits as TP x CP x DP inside one pipeline stage are cut as expert-TP x EP x expert-DP)::

    expert-DP = world / (expert-TP x EP x PP)
    rank = ((pp_rank * expert-DP + expert_dp_rank) * EP + ep_rank) * expert-TP + expert_tp_rank

EP x expert-TP must divide TP x CP x DP (the ranks of one pipeline stage). Groups:
``expert_tensor`` (expert-TP), ``expert`` (EP: the ranks holding different experts),
``expert_data`` (expert-DP: the replicas of one expert shard; expert gradients reduce and the
distributed optimizer's expert part shards over it), ``tensor_expert`` (expert-TP x EP) and
``tensor_expert_pipeline`` (expert-TP x EP x PP: the expert part's norm is summed over it, as
the dense part's over ``model``). At EP = 1 and expert-TP = TP the expert grid is the dense one:
``expert_tensor`` = ``tensor``, ``expert_data`` = ``data_context``,
``tensor_expert_pipeline`` = ``model``.

The 16-rank layout above (TP=2, CP=2, PP=2, DP=2) with EP=2 (expert-TP = TP = 2, expert-DP =
16 / (2 x 2 x 2) = 2; EP folded over CP)::

    expert-tensor groups:     [0, 1] [2, 3] [4, 5] [6, 7] [8, 9] [10, 11] [12, 13] [14, 15]
    expert groups (EP):       [0, 2] [1, 3] [4, 6] [5, 7] [8, 10] [9, 11] [12, 14] [13, 15]
    expert-data groups:       [0, 4] [1, 5] [2, 6] [3, 7] [8, 12] [9, 13] [10, 14] [11, 15]
    tensor x expert groups:   [0, 1, 2, 3] [4, 5, 6, 7] [8, 9, 10, 11] [12, 13, 14, 15]
    tensor x expert x pipeline groups:
                              [0, 1, 2, 3, 8, 9, 10, 11] [4, 5, 6, 7, 12, 13, 14, 15]

The same layout with EP=4 and expert-TP=1 (expert-DP = 16 / (1 x 4 x 2) = 2; EP folded over
TP x CP, expert-DP over DP)::

    expert-tensor groups:     [0] [1] ... [15]  (groups of one)
    expert groups (EP):       [0, 1, 2, 3] [4, 5, 6, 7] [8, 9, 10, 11] [12, 13, 14, 15]
    expert-data groups:       [0, 4] [1, 5] [2, 6] [3, 7] [8, 12] [9, 13] [10, 14] [11, 15]
    tensor x expert groups:   the expert groups
    tensor x expert x pipeline groups:
                              [0, 1, 2, 3, 8, 9, 10, 11] [4, 5, 6, 7, 12, 13, 14, 15]

Rank 2 holds the attention weights of tensor rank 0 (as rank 0) and, at EP=4, the experts of EP
rank 2: its expert gradients are reduced with rank 6's only (expert-DP [2, 6]), its dense
gradients over the data x context group [0, 2, 4, 6].
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

# Dimensions in rank order, fastest first (Megatron-Core's "tp-cp-dp-pp").
_ORDER = ("tp", "cp", "dp", "pp")
# The expert grid's order (Megatron-Core's expert RankGenerator, "tp-ep-dp-pp"): expert-TP,
# EP, expert-DP, PP.
_EXPERT_ORDER = ("etp", "ep", "edp", "pp")

# Kind of group -> the dimensions its members differ in.
_VARYING = {"tensor": ("tp",), "context": ("cp",), "data": ("dp",), "data_context": ("cp", "dp"),
            "pipeline": ("pp",), "model": ("tp", "pp"), "tensor_context": ("tp", "cp")}
_EXPERT_VARYING = {"expert_tensor": ("etp",), "expert": ("ep",), "expert_data": ("edp",),
                   "tensor_expert": ("etp", "ep"), "tensor_expert_pipeline": ("etp", "ep", "pp")}

# ProcessGroupCollection's expert fields, and the layout kind each holds.
EXPERT_FIELDS = {"ep": "expert", "expt_tp": "expert_tensor", "expt_dp": "expert_data",
                 "tp_ep": "tensor_expert", "tp_ep_pp": "tensor_expert_pipeline"}

# Creation order of the groups (torch.distributed.new_group is collective over the whole world).
CREATION_ORDER = ("data", "data_context", "context", "model", "tensor", "pipeline", "embedding",
                  "expert_tensor", "expert", "expert_data", "tensor_expert",
                  "tensor_expert_pipeline", "tensor_context")


@dataclass(frozen=True)
class PlannedGroup:
    """A group of a layout that is only planned, not created: its size and this rank's place in
    it, no communicator. Modules built on the meta device with planned groups
    (:func:`megatron.planner.inventory.build_meta_stage`) have the shapes of that rank's shard;
    they must never run (a collective on a planned group fails in ``torch.distributed``)."""

    size: int
    rank: int = 0


def group_size(group) -> int:
    """Number of ranks of ``group``; 1 for None (a world of one)."""
    if isinstance(group, PlannedGroup):
        return group.size
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside ``group``; 0 for None (a world of one)."""
    if isinstance(group, PlannedGroup):
        return group.rank
    return 0 if group is None else dist.get_rank(group)


def _groups_varying(sizes: Dict[str, int], varying: Tuple[str, ...],
                    order: Tuple[str, ...] = _ORDER) -> List[List[int]]:
    """Every group whose members differ exactly in the ``varying`` dimensions, as sorted global
    ranks; groups enumerated with the fixed dimensions in rank ``order`` (fastest first), as
    Megatron-Core's ``RankGenerator.get_ranks`` lists them."""
    strides, stride = {}, 1
    for dim in order:
        strides[dim] = stride
        stride *= sizes[dim]
    fixed = [d for d in order if d not in varying]
    groups = []
    # itertools.product varies its last factor fastest: list the fixed dimensions slowest first.
    for fixed_pos in itertools.product(*(range(sizes[d]) for d in reversed(fixed))):
        base = sum(p * strides[d] for d, p in zip(reversed(fixed), fixed_pos))
        members = [base + sum(p * strides[d] for d, p in zip(varying, pos))
                   for pos in itertools.product(*(range(sizes[d]) for d in varying))]
        groups.append(sorted(members))
    return groups


def expert_layout_error(world_size: int, tensor_model_parallel_size: int,
                        pipeline_model_parallel_size: int, context_parallel_size: int,
                        expert_model_parallel_size: int,
                        expert_tensor_parallel_size: int) -> Optional[str]:
    """Why the expert grid does not fit the layout (one line naming the flags), or None.

    EP x expert-TP must divide TP x CP x DP, the ranks of one pipeline stage (Megatron-Core's
    ``decoder_world_size % (expert-TP x EP x PP) == 0``)."""
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    if ep < 1 or etp < 1:
        return (f"--expert-model-parallel-size ({ep}) and --expert-tensor-parallel-size ({etp}) "
                f"must be >= 1")
    stage = world_size // pipeline_model_parallel_size  # TP x CP x DP
    if stage % (ep * etp) != 0:
        return (f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size ({etp}) "
                f"= {ep * etp} must divide the ranks of one pipeline stage, TP x CP x DP = "
                f"{stage} (world {world_size} / --pipeline-model-parallel-size "
                f"{pipeline_model_parallel_size}); choose sizes whose product divides {stage}")
    return None


def layout_groups(world_size: int, tensor_model_parallel_size: int,
                  pipeline_model_parallel_size: int, context_parallel_size: int = 1,
                  expert_model_parallel_size: int = 1,
                  expert_tensor_parallel_size: Optional[int] = None) -> dict:
    """Every group of a layout as lists of global ranks, without creating any group.

    Pure function (no process group needed), used by ``initialize_model_parallel`` and by tests
    and tools that print a layout. Rank order and the expert grid: see the module docstring.

    Args:
        expert_model_parallel_size: EP (``--expert-model-parallel-size``), default 1.
        expert_tensor_parallel_size: expert-TP (``--expert-tensor-parallel-size``); None: TP.

    Returns:
        dict with keys ``tensor``, ``context``, ``data``, ``data_context`` (DP x CP),
        ``tensor_context`` (TP x CP),
        ``pipeline``, ``model`` (TP x PP), ``embedding`` (first and last rank of each pipeline
        group; the one rank at PP = 1), and the expert grid's ``expert_tensor``, ``expert``
        (EP), ``expert_data``, ``tensor_expert`` (expert-TP x EP), ``tensor_expert_pipeline``
        (expert-TP x EP x PP); each a list of rank lists, in creation order.

    Raises:
        ValueError: if a size is below 1, ``world_size`` is not divisible by TP x CP x PP, or
            EP x expert-TP does not divide TP x CP x DP (:func:`expert_layout_error`).
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
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    error = expert_layout_error(world_size, tp, pp, cp, ep, etp)
    if error:
        raise ValueError(error)
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": world_size // (tp * pp * cp)}
    groups = {kind: _groups_varying(sizes, varying) for kind, varying in _VARYING.items()}
    groups["embedding"] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in groups["pipeline"]]
    expert_sizes = {"etp": etp, "ep": ep, "pp": pp, "edp": world_size // (etp * ep * pp)}
    for kind, varying in _EXPERT_VARYING.items():
        groups[kind] = _groups_varying(expert_sizes, varying, _EXPERT_ORDER)
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
        ep: expert-parallel group (EP: the ranks holding different experts).
        expt_tp: expert tensor-parallel group (expert-TP).
        expt_dp: expert data-parallel group: the replicas of this rank's expert shard; expert
            gradients are reduced and the distributed optimizer's expert part shards over it.
        tp_ep: expert-TP x EP group.
        tp_ep_pp: expert-TP x EP x PP group: the expert part's gradient norm is summed over it
            (one full set of experts, as ``model`` is one full dense model).
        tp_cp: tensor x context-parallel group (Megatron-Core's ``tp_cp``): the ranks that split
            one micro-batch's tokens under sequence and context parallelism together (a MoE
            layer's token set); a group of one without communicator at TP = CP = 1.

    The five expert groups default to this rank alone (groups of one, no communicator), the
    expert grid of a collection built without one; ``initialize_model_parallel`` fills them.
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
    ep: Optional[ParallelGroup] = None
    expt_tp: Optional[ParallelGroup] = None
    expt_dp: Optional[ParallelGroup] = None
    tp_ep: Optional[ParallelGroup] = None
    tp_ep_pp: Optional[ParallelGroup] = None
    tp_cp: Optional[ParallelGroup] = None

    def __post_init__(self):
        for name in (*EXPERT_FIELDS, "tp_cp"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, ParallelGroup.of_one(None, self.rank))

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
