"""Global gradient norm, clipping and zero counting over a model split by TP and PP.

After Megatron-LM's ``megatron/core/optimizer/clip_grads.py``. The caller chooses which gradients
enter the norm so that every element of the whole model is counted exactly once
(:func:`grads_for_norm`); the per-rank partial sums are then summed over the model-parallel group
(TP x PP; expert parameters: expert-TP x EP x PP, ``tp_ep_pp``, their duplicates found over
``expt_tp``). Data parallelism needs no sum: gradients are already reduced, so the DP replicas hold
identical values; gradients sharded over data parallelism (the distributed optimizer) add their
data-parallel group. Every group is an argument: None means no reduction (a group of one), never
a group looked up elsewhere.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel.utils import param_is_not_tensor_parallel_duplicate


def param_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient the optimizer uses: ``main_grad`` (DDP buffers) if present, else ``grad``."""
    g = getattr(param, "main_grad", None)
    return g if g is not None else param.grad


def model_parallel_group_of(pg_collection: ProcessGroupCollection, expert: bool = False):
    """The group the norm's partial sums are combined over: the model-parallel group (TP x PP;
    for expert parameters expert-TP x EP x PP, ``tp_ep_pp``: one full set of experts), or None
    when it is this rank alone."""
    group = pg_collection.tp_ep_pp if expert else pg_collection.model
    return group.group if group.size > 1 else None


def grads_for_norm(params: Iterable[torch.nn.Parameter],
                   pg_collection: ProcessGroupCollection,
                   expert: bool = False) -> List[torch.Tensor]:
    """Gradients of ``params`` that this rank contributes to the global norm.

    Skipped, so that each element is counted once across the model:
      * tensor-parallel duplicates (params without ``tensor_model_parallel``) on TP ranks > 0 of
        ``pg_collection.tp`` (``expt_tp`` for ``expert`` parameters);
      * the copy of a tied embedding (``shared_embedding=True``) on pipeline stages other than
        the first (the first stage's word embedding counts).
    """
    first_stage = pg_collection.is_pipeline_first_stage()
    tp_group = (pg_collection.expt_tp if expert else pg_collection.tp).group
    out = []
    for p in params:
        g = param_grad(p)
        if g is None:
            continue
        if getattr(p, "shared_embedding", False) and not first_stage:
            continue
        if not param_is_not_tensor_parallel_duplicate(p, tp_group):
            continue
        out.append(g)
    return out


def get_grad_norm_fp32(grads: List[torch.Tensor], norm_type: float = 2.0, *,
                       model_parallel_group, data_parallel_group) -> float:
    """Norm of the gradients of the whole model, computed in fp32.

    Args:
        grads: this rank's share (see :func:`grads_for_norm`).
        norm_type: p of the p-norm; ``inf`` for the max norm.
        model_parallel_group: group to combine partial results over (sum of p-th powers, or max);
            None for a single model-parallel rank (:func:`model_parallel_group_of`).
        data_parallel_group: also combine over this group, for gradients sharded over data
            parallelism (distributed optimizer); None when every DP rank holds all gradients.

    Returns:
        the total norm as a Python float (identical on every rank of the group).
    """
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == math.inf:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            total = torch.maximum(total, g.detach().abs().max().float())
        if data_parallel_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=data_parallel_group)
        if model_parallel_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=model_parallel_group)
        return total.item()
    total = grad_norm_power_fp32(grads, norm_type, model_parallel_group=model_parallel_group,
                                 data_parallel_group=data_parallel_group)
    return total.item() ** (1.0 / norm_type)


def grad_norm_power_fp32(grads: List[torch.Tensor], norm_type: float = 2.0, *,
                         model_parallel_group, data_parallel_group,
                         device: Optional[torch.device] = None) -> torch.Tensor:
    """The sum of ``|g| ** norm_type`` over the gradients of the whole model (finite p), combined
    over the groups as in :func:`get_grad_norm_fp32`: a 0-dim fp64 tensor on ``device`` (default
    the gradients'; host gradients of the offloaded optimizer reduce on the model's device, as
    NCCL needs), read by nobody here (no host sync).

    Accurate to fp32 rounding whatever the layout (:func:`tensor_power_sums`); the per-tensor
    sums and their combination over the groups are fp64, so a tensor-parallel split, a pipeline
    split or a data-parallel shard of the same gradients gives the same value within about 1e-9
    relative.
    """
    device = device or (grads[0].device if grads else torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    if grads:
        total = tensor_power_sums(grads, norm_type).sum().to(device)
    if data_parallel_group is not None:
        dist.all_reduce(total, group=data_parallel_group)
    if model_parallel_group is not None:
        dist.all_reduce(total, group=model_parallel_group)
    return total


# Elements per fp32 partial sum on the CPU: small enough that one fp32 accumulator stays exact
# to ~1e-9 relative, large enough that the row-wise reduction runs at memory speed.
_CPU_BLOCK = 1024


def tensor_power_sums(grads: List[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """``sum(|g| ** norm_type)`` of each gradient, a 1-D fp64 tensor (one entry per gradient).

    torch's CPU norm kernel (``torch._foreach_norm``, ``torch.linalg.vector_norm``) accumulates a
    whole tensor in fp32 lanes: ``|g|**2`` comes out 2e-5 low at 1M elements and 1e-2 low at 65M,
    and a tensor-parallel split (two halves, each summed alike) is off by less, so the clip
    factor would depend on the layout. On the CPU each gradient is therefore reduced in rows of
    ``_CPU_BLOCK`` elements (fp32, one pass, no copy of a contiguous gradient) and the rows are
    summed in fp64: within 2e-9 of the fp64 sum at 1M to 65M elements, at the speed of
    ``_foreach_norm``. On CUDA ``torch._foreach_norm`` reduces each tensor as a tree (per-thread
    partial sums of a few dozen elements, then block and chunk reductions), one launch for all
    tensors and no host sync; only the sum over tensors is fp64 here.
    """
    grads = [g.detach() if g.dtype == torch.float32 else g.detach().float() for g in grads]
    if grads[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(grads, norm_type)).double().pow(norm_type)
    sums = []
    for g in grads:
        flat = g.reshape(-1)
        rows = flat.numel() // _CPU_BLOCK
        part = torch.zeros((), dtype=torch.float64)
        if rows:
            body = flat[:rows * _CPU_BLOCK].view(rows, _CPU_BLOCK)
            part = torch.linalg.vector_norm(body, norm_type, dim=1).double().pow(norm_type).sum()
        if flat.numel() > rows * _CPU_BLOCK:
            tail = torch.linalg.vector_norm(flat[rows * _CPU_BLOCK:], norm_type)
            part = part + tail.double().pow(norm_type)
        sums.append(part)
    return torch.stack(sums)


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """``max_norm / (total_norm + 1e-6)``: the factor clipping scales every gradient by when it is
    below 1 (Megatron's rule, and ``torch.nn.utils.clip_grad_norm_``'s): the clipped norm is then
    at most ``max_norm``."""
    return max_norm / (total_norm + 1.0e-6)


def clip_grads_by_total_norm(grads: List[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place by :func:`clip_coefficient` when that is below 1."""
    clip_coeff = clip_coefficient(max_norm, total_norm)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def clip_grad_norm_fp32(params: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2.0, *, pg_collection: ProcessGroupCollection) -> float:
    """Compute the global gradient norm of ``params`` (each element counted once over the
    model-parallel group of ``pg_collection``) and clip all their gradients by it.

    Returns:
        the total norm before clipping.
    """
    params = list(params)
    total = get_grad_norm_fp32(grads_for_norm(params, pg_collection), norm_type,
                               model_parallel_group=model_parallel_group_of(pg_collection),
                               data_parallel_group=None)
    all_grads = [g for g in (param_grad(p) for p in params) if g is not None]
    clip_grads_by_total_norm(all_grads, max_norm, total)
    return total


def count_zeros_fp32(params: Iterable[torch.nn.Parameter], *,
                     pg_collection: ProcessGroupCollection, data_parallel_group,
                     expert: bool = False) -> int:
    """Number of zero gradient elements over the whole model, each counted once (as the norm,
    over the model-parallel group of ``pg_collection``, ``tp_ep_pp`` for ``expert``
    parameters); ``data_parallel_group`` as in :func:`get_grad_norm_fp32`."""
    model_parallel_group = model_parallel_group_of(pg_collection, expert)
    grads = grads_for_norm(params, pg_collection, expert)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += g.numel() - torch.count_nonzero(g)
    if data_parallel_group is not None:
        dist.all_reduce(total, group=data_parallel_group)
    if model_parallel_group is not None:
        dist.all_reduce(total, group=model_parallel_group)
    return int(total.item())
