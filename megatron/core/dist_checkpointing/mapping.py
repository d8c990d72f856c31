"""Tensors in global coordinates: what a rank holds of each layout-free tensor of a checkpoint.

A :class:`ShardedTensor` is one box of a *global* tensor (the tensor as one process without any
parallelism would hold it): its key, the box's values on this rank, the global shape and the box's
offset in it (Megatron-Core's ``dist_checkpointing.ShardedTensor``; a ``torch.distributed.checkpoint``
chunk). A rank may hold several boxes of one key.

A :class:`ParamSharding` says where a *local* parameter lies in global tensors, as row regions:
rows ``[start, stop)`` of the local tensor are a box of global tensor ``key`` at ``offset``. A
tensor-parallel partition is one region; a fused weight whose per-rank rows are ``[q_r; k_r; v_r]``
is three (one per global tensor), so no copy and no communication is needed to save it in a
TP-independent form. From it:

* :meth:`ParamSharding.boxes` gives the boxes of a tensor shaped like the parameter (weights,
  Adam moments and fp32 main params of a plain optimizer);
* :meth:`ParamSharding.flat_boxes` gives the boxes of the elements ``[start, stop)`` of the
  flattened parameter (the distributed optimizer's pieces, or a ZeRO-3 parameter shard): in each
  region at most three boxes, a partial first row, whole rows, a partial last row.

Replicas (the same values on several ranks: data-parallel copies, tensor-parallel duplicates such
as norm weights, the tied embedding's copy on the last pipeline stage) carry ``replica_id > 0``
everywhere but on the one rank that writes them; :func:`balance_writers` spreads the writing of
data-parallel replicas over the data-parallel ranks by bytes (Megatron-Core's fully parallel save).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class ShardedTensor:
    """One box of a global tensor held by this rank.

    Attributes:
        key: the global tensor's layout-free name (e.g. ``model.layers.3.self_attention.query.weight``).
        data: the box's values, shape = the box's size (a view of the rank's storage, so a load
            writes in place).
        global_shape: shape of the global tensor.
        global_offset: index of the box's first element in the global tensor, one per dimension.
        replica_id: 0 on the rank that writes the box; another rank holds and writes the same
            values when it is > 0. Every rank reads the boxes it holds, replica or not.
        resizable: the first dimension is a padded vocabulary, which may differ between the run
            that saved and the run that loads (padding depends on the tensor-parallel size):
            only the rows both have are read.
        replica_group: the global ranks holding this same box (its data-parallel replicas:
            ``dp_cp`` for dense parameters, ``expt_dp`` for expert ones), among which
            :func:`balance_writers_by_group` picks its one writer; ``()`` for a box this rank
            alone holds (a distributed-optimizer shard).
    """

    key: str
    data: torch.Tensor
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: int = 0
    resizable: bool = False
    replica_group: Tuple[int, ...] = ()

    def __post_init__(self):
        shape = tuple(self.data.shape)
        if len(shape) != len(self.global_shape) or len(shape) != len(self.global_offset):
            raise ValueError(f"{self.key}: box of shape {shape} at {self.global_offset} does not "
                             f"match the dimensions of the global shape {self.global_shape}")
        for size, offset, full in zip(shape, self.global_offset, self.global_shape):
            if offset < 0 or offset + size > full:
                raise ValueError(f"{self.key}: box of shape {shape} at {self.global_offset} lies "
                                 f"outside the global shape {self.global_shape}")

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def with_data(self, data: torch.Tensor) -> "ShardedTensor":
        """The same box holding ``data`` (e.g. a host copy)."""
        return dataclasses.replace(self, data=data)

    def clipped_rows(self, rows: int) -> Optional["ShardedTensor"]:
        """The part of the box in the first ``rows`` rows of the global tensor (a view), None if
        it has none; for loading a resizable tensor saved with fewer rows."""
        first = self.global_offset[0]
        keep = min(self.data.shape[0], rows - first)
        if keep <= 0:
            return None
        return dataclasses.replace(self, data=self.data[:keep],
                                   global_shape=(rows, *self.global_shape[1:]))


@dataclass(frozen=True)
class Region:
    """Rows ``[start, stop)`` of a local tensor are the box of global tensor ``key`` whose first
    element is at ``global_offset`` (all columns of the local tensor: a tensor-parallel partition
    along dimension 1 is an offset in the second coordinate)."""

    key: str
    start: int
    stop: int
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]


@dataclass(frozen=True)
class ParamSharding:
    """Where a local parameter lies in global tensors (see the module docstring).

    Attributes:
        local_shape: the parameter's shape on this rank.
        regions: row regions covering the local rows ``0..local_shape[0]`` in order.
        replica_id: > 0 when another rank writes the same values (a tensor-parallel duplicate on
            TP rank > 0, the tied embedding's copy on the last pipeline stage).
        resizable: the first dimension is a padded vocabulary (see :class:`ShardedTensor`).
        replica_group: the global ranks holding the same parameter (see
            :class:`ShardedTensor`); its :meth:`boxes` carry it, its :meth:`flat_boxes` (one
            rank's shard) do not.
        param_shape: the parameter's own shape when the regions describe a row-major view of it
            of another shape (``local_shape``, same elements in the same order; the grouped
            experts split over expert-TP, :meth:`expert_row_blocks`); None: ``local_shape``.
    """

    local_shape: Tuple[int, ...]
    regions: Tuple[Region, ...]
    replica_id: int = 0
    resizable: bool = False
    replica_group: Tuple[int, ...] = ()
    param_shape: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        at = 0
        for r in self.regions:
            if r.start != at or r.stop <= r.start:
                raise ValueError(f"regions of {r.key} must cover the local rows in order")
            at = r.stop
        if at != self.local_shape[0]:
            raise ValueError(f"regions cover {at} of the {self.local_shape[0]} local rows")
        if self.param_shape is not None and \
                math.prod(self.param_shape) != math.prod(self.local_shape):
            raise ValueError(f"a view of shape {self.local_shape} of a parameter of shape "
                             f"{self.param_shape}")

    @classmethod
    def partition(cls, key: str, local_shape: Sequence[int], partition_dim: Optional[int],
                  tp_rank: int, tp_size: int, *, replica_id: int = 0,
                  resizable: bool = False,
                  replica_group: Tuple[int, ...] = ()) -> "ParamSharding":
        """One region: the whole local tensor, partition ``tp_rank`` of ``tp_size`` along
        ``partition_dim`` of the global tensor (None: not partitioned, the same on every
        tensor-parallel rank)."""
        local_shape = tuple(local_shape)
        global_shape, offset = list(local_shape), [0] * len(local_shape)
        if partition_dim is not None:
            global_shape[partition_dim] *= tp_size
            offset[partition_dim] = tp_rank * local_shape[partition_dim]
        region = Region(key, 0, local_shape[0], tuple(global_shape), tuple(offset))
        return cls(local_shape, (region,), replica_id, resizable, tuple(replica_group))

    @classmethod
    def row_blocks(cls, blocks: Sequence[Tuple[str, int]], local_shape: Sequence[int],
                   tp_rank: int, tp_size: int, *,
                   replica_group: Tuple[int, ...] = ()) -> "ParamSharding":
        """A fused column-parallel weight whose local rows are ``rows_j`` rows of each global
        tensor ``key_j`` in turn (``blocks = [(key_j, rows_j)]``), partition ``tp_rank`` of each.
        """
        regions, at = [], 0
        for key, rows in blocks:
            global_shape = (rows * tp_size, *local_shape[1:])
            regions.append(Region(key, at, at + rows, global_shape,
                                  (tp_rank * rows,) + (0,) * (len(local_shape) - 1)))
            at += rows
        return cls(tuple(local_shape), tuple(regions), replica_group=tuple(replica_group))

    @classmethod
    def expert_axis(cls, key: str, local_shape: Sequence[int], num_experts: int,
                    first_expert: int, *, replica_id: int = 0,
                    replica_group: Tuple[int, ...] = (), partition_dim: Optional[int] = None,
                    tp_rank: int = 0, tp_size: int = 1) -> "ParamSharding":
        """Grouped expert weights ``[E_local, ...]`` whose dim 0 is experts ``first_expert ..
        first_expert + E_local - 1`` of the global ``[num_experts, ...]`` (Megatron-Core's
        global expert index; the box of one expert-parallel rank); with ``partition_dim`` (> 0)
        also expert-TP slice ``tp_rank`` of ``tp_size`` along that dimension (``weight2``'s
        columns ``f_t``)."""
        local_shape = tuple(local_shape)
        if first_expert < 0 or first_expert + local_shape[0] > num_experts:
            raise ValueError(f"{key}: experts {first_expert}..{first_expert + local_shape[0] - 1}"
                             f" outside the {num_experts} experts")
        global_shape = [num_experts, *local_shape[1:]]
        offset = [first_expert] + [0] * (len(local_shape) - 1)
        if partition_dim is not None:
            global_shape[partition_dim] *= tp_size
            offset[partition_dim] = tp_rank * local_shape[partition_dim]
        region = Region(key, 0, local_shape[0], tuple(global_shape), tuple(offset))
        return cls(local_shape, (region,), replica_id, False, tuple(replica_group))

    @classmethod
    def expert_row_blocks(cls, key: str, num_blocks: int, local_shape: Sequence[int],
                          num_experts: int, first_expert: int, tp_rank: int, tp_size: int, *,
                          replica_group: Tuple[int, ...] = ()) -> "ParamSharding":
        """Grouped expert weights ``[E_local, B*r, c]`` split over expert-TP whose dim 1 is, per
        expert, ``r`` rows of each of ``B = num_blocks`` fused blocks in turn (``[gate_t; up_t]`` of
        ``weight1``), rank ``tp_rank``'s slice of each block: block ``b`` of local expert ``i`` is
        rows ``[b*R + tp_rank*r, b*R + (tp_rank+1)*r)`` (``R = r * tp_size``) of expert
        ``first_expert + i`` in the global ``[num_experts, B*R, c]``, as at expert-TP 1. The
        regions describe the row-major view ``[E_local*B, r, c]`` (one row per expert and block:
        ``param_shape`` is the parameter's shape), so a saved tensor does not depend on expert-TP.
        """
        param_shape = tuple(local_shape)
        experts, rows, rest = param_shape[0], param_shape[1], param_shape[2:]
        n = num_blocks
        if rows % n:
            raise ValueError(f"{key}: {rows} rows per expert are not {n} equal blocks")
        r = rows // n
        if first_expert < 0 or first_expert + experts > num_experts:
            raise ValueError(f"{key}: experts {first_expert}..{first_expert + experts - 1}"
                             f" outside the {num_experts} experts")
        global_shape = (num_experts, n * r * tp_size, *rest)
        regions = [Region(key, i * n + b, i * n + b + 1, global_shape,
                          (first_expert + i, b * r * tp_size + tp_rank * r) + (0,) * len(rest))
                   for i in range(experts) for b in range(n)]
        return cls((experts * n, r, *rest), tuple(regions), replica_group=tuple(replica_group),
                   param_shape=param_shape)

    @property
    def row_numel(self) -> int:
        """Elements per local row (1 for a 1-D tensor)."""
        return math.prod(self.local_shape[1:])

    def boxes(self, tensor: torch.Tensor, prefix: str) -> List[ShardedTensor]:
        """The boxes of ``tensor`` (shaped like the parameter), keys prefixed with ``prefix``."""
        shape = self.param_shape or self.local_shape
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor of shape {tuple(tensor.shape)} for a parameter of shape "
                             f"{shape}")
        tensor = tensor.view(self.local_shape)  # a view: a load writes into the parameter
        return [ShardedTensor(prefix + r.key, tensor[r.start:r.stop], r.global_shape,
                              r.global_offset, self.replica_id, self.resizable,
                              self.replica_group)
                for r in self.regions]

    def flat_boxes(self, start: int, stop: int, flat: torch.Tensor,
                   prefix: str) -> List[ShardedTensor]:
        """The boxes of elements ``[start, stop)`` of the flattened parameter, whose values are the
        1-D ``flat`` (``stop - start`` elements; every box is a view of it). In each region, per
        dimension at most a partial leading block, whole blocks and a partial trailing block
        (a 2-D range: a partial first row, whole rows, a partial last row; a 3-D range of grouped
        experts ``[E_local, r, c]`` adds whole experts between).

        Raises:
            ValueError: for a range outside the parameter.
        """
        width = self.row_numel
        if not 0 <= start <= stop <= self.local_shape[0] * width or flat.numel() != stop - start:
            raise ValueError(f"elements [{start}, {stop}) with {flat.numel()} values for a "
                             f"parameter of shape {self.local_shape}")
        out = []
        for r in self.regions:
            shape = (r.stop - r.start,) + self.local_shape[1:]
            lo, hi = max(start, r.start * width), min(stop, r.stop * width)
            for offset, size in _nd_boxes(lo - r.start * width, hi - r.start * width, shape):
                first = r.start * width + sum(o * s for o, s in zip(offset, _strides(shape))) \
                    - start
                values = flat[first:first + math.prod(size)].view(size)
                at = tuple(g + o for g, o in zip(r.global_offset, offset))
                out.append(ShardedTensor(prefix + r.key, values, r.global_shape, at,
                                         self.replica_id, self.resizable))
        return out


def _strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def _nd_boxes(lo: int, hi: int, shape: Sequence[int]
              ) -> Iterable[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """``(offset, size)`` boxes covering flat elements ``[lo, hi)`` of a row-major tensor of
    ``shape``, in order: along dim 0 a partial first slice (recursively boxed), whole slices,
    a partial last slice."""
    if hi <= lo:
        return
    if len(shape) == 1:
        yield (lo,), (hi - lo,)
        return
    rest = tuple(shape[1:])
    width = math.prod(rest)
    at = lo
    while at < hi:
        row, col = divmod(at, width)
        if col or hi - at < width:
            end = min((row + 1) * width, hi)
            for offset, size in _nd_boxes(col, end - row * width, rest):
                yield (row, *offset), (1, *size)
            at = end
        else:
            rows = (hi - at) // width
            yield (row,) + (0,) * len(rest), (rows, *rest)
            at += rows * width


def balance_writers_by_group(tensors: Sequence[ShardedTensor],
                             global_rank: int) -> List[ShardedTensor]:
    """:func:`balance_writers` within each box's own ``replica_group`` (dense boxes among the
    data x context ranks, expert boxes among the expert-data ranks), order kept; boxes of no
    group (this rank's alone) as they are.

    Raises:
        ValueError: a box whose replica group does not hold ``global_rank``.
    """
    by_group = {}
    for i, t in enumerate(tensors):
        if t.replica_group:
            by_group.setdefault(t.replica_group, []).append(i)
    out = list(tensors)
    for group, members in by_group.items():
        if global_rank not in group:
            raise ValueError(f"{tensors[members[0]].key}: replica group {list(group)} does not "
                             f"hold rank {global_rank}")
        chosen = balance_writers([tensors[i] for i in members], group.index(global_rank),
                                 len(group))
        for i, t in zip(members, chosen):
            out[i] = t
    return out


def balance_writers(tensors: Sequence[ShardedTensor], rank: int, size: int) -> List[ShardedTensor]:
    """Choose, for boxes held identically by the ``size`` ranks of a replica group (data-parallel
    copies), which rank writes each: the largest first, each to the rank with the fewest bytes so
    far (lowest rank on ties). Every rank of the group computes the same assignment from the same
    list; boxes already marked as replicas stay so.

    Returns:
        the boxes, with ``replica_id`` 0 where this ``rank`` writes them and 1 elsewhere.
    """
    if size == 1:
        return list(tensors)
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i].nbytes, tensors[i].key,
                                                       tensors[i].global_offset))
    load = [0] * size
    writer = {}
    for i in order:
        if tensors[i].replica_id:
            continue
        target = min(range(size), key=lambda r: (load[r], r))
        load[target] += tensors[i].nbytes
        writer[i] = target
    return [t if t.replica_id or writer[i] == rank else dataclasses.replace(t, replica_id=1)
            for i, t in enumerate(tensors)]
