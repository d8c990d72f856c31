"""Grouped expert weights split over expert tensor parallelism, and back: the arithmetic that lets a
legacy checkpoint (``--ckpt-format torch``) saved at one ``--expert-tensor-parallel-size`` load at
another.

Expert-TP rank ``r`` of ``k`` holds, of every local expert (``GroupedMLP``), rows
``[gate_r; up_r]`` of ``weight1`` (``[E_local, 2f/k, h]``) and columns ``f_r`` of ``weight2``
(``[E_local, h, f/k]``), ``f_r`` the r-th of k equal slices of the width (Megatron-Core's column
split of ``linear_fc1``, whose ``[gate; up]`` halves are split separately, and row split of
``linear_fc2``). A tensor's kind follows from its name: ``...weight1`` or ``...weight2``.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError


def _kind(name: str) -> str:
    for kind in ("weight1", "weight2"):
        if name == kind or name.endswith("." + kind):
            return kind
    raise CheckpointError(f"expert tensor {name}: only the grouped experts' weight1 / weight2 "
                          "are split over expert-TP; this model's experts are not")


def merge(name: str, slices: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole experts ``[E_local, 2f, h]`` / ``[E_local, h, f]`` from the ``k`` expert-TP
    slices of the tensor ``name``, in expert-TP rank order (any dtype; a copy)."""
    if len(slices) == 1:
        return slices[0]
    if _kind(name) == "weight2":
        return torch.cat(list(slices), dim=2)
    halves = [s.chunk(2, dim=1) for s in slices]  # [gate_r; up_r]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)


def cut(name: str, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Expert-TP rank ``rank``'s slice of ``size`` of the whole experts ``whole`` (a copy).

    Raises:
        CheckpointError: the width is not divisible by ``size``."""
    if size == 1:
        return whole.clone()
    dim = 2 if _kind(name) == "weight2" else 1
    width = whole.shape[dim] // (1 if dim == 2 else 2)
    if width % size:
        raise CheckpointError(f"expert tensor {name} of width {width} cannot be split over "
                              f"--expert-tensor-parallel-size {size}")
    f = width // size
    if dim == 2:
        return whole[:, :, rank * f:(rank + 1) * f].clone()
    gate, up = whole.chunk(2, dim=1)
    return torch.cat([gate[:, rank * f:(rank + 1) * f], up[:, rank * f:(rank + 1) * f]], dim=1)


def gather_whole(name: str, param: torch.Tensor, group) -> torch.Tensor:
    """The whole experts of ``param`` (this rank's expert-TP slice), all-gathered over the
    expert-TP ``group`` (a ``ProcessGroupInfo``; collective over it)."""
    import torch.distributed as dist

    if group.size == 1:
        return param.detach()
    parts: List[torch.Tensor] = [torch.empty_like(param) for _ in range(group.size)]
    dist.all_gather(parts, param.detach().contiguous(), group=group.group)
    return merge(name, parts)
