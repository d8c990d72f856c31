"""Everything that happens to gradients between the last backward and the optimizer step.

After Megatron-Core's ``finalize_model_grads``, in its order:

1. data-parallel reduction of every chunk (``finish_grad_sync``),
2. all-reduce (sum) over the tensor-parallel group of the gradients of parameters marked
   ``sequence_parallel=True`` (norm weights computed on ``[s/TP, b, h]`` shards),
3. all-reduce (sum) over the embedding group (first and last pipeline stage) of the gradients of
   parameters marked ``shared_embedding=True`` (tied word embedding / output weight at PP > 1),
4. with per-token loss (``num_tokens`` given): broadcast the token count from the last pipeline
   stage, sum it over the data x context-parallel group and divide every gradient by it.

Every group comes from the ``pg_collection`` argument
(:class:`~megatron.core.process_groups.ProcessGroupCollection`); groups of one communicate
nothing, so ``ProcessGroupCollection.world_of_one()`` serves a single process.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.process_groups import ProcessGroupCollection


def _grad(chunk, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The reduced gradient of ``param``: under DDP its ``reduced_grad`` (``main_grad``, or with
    sharded gradients the part of the rank's shard that is ``param``'s), else ``grad``."""
    if isinstance(chunk, DistributedDataParallel):
        return chunk.reduced_grad(param)
    return param.grad


def _unique_params(model_chunks):
    """``(chunk, param)`` for every trainable parameter, once."""
    seen = set()
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                yield chunk, p


def _allreduce_coalesced(grads: List[torch.Tensor], group) -> None:
    """Sum ``grads`` over ``group`` with one collective (flatten, all-reduce, copy back)."""
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def _allreduce_sequence_parallel_grads(model_chunks, pg_collection) -> None:
    """Collective: all-reduce (sum) over the tensor-parallel group."""
    if pg_collection.tp.size == 1:
        return
    # With sharded gradients each TP rank's shard pieces match: equal layouts on the TP ranks.
    grads = [_grad(c, p) for c, p in _unique_params(model_chunks)
             if getattr(p, "sequence_parallel", False) and _grad(c, p) is not None]
    _allreduce_coalesced(grads, pg_collection.tp.group)


def _allreduce_embedding_grads(model_chunks, pg_collection) -> None:
    """Collective: all-reduce (sum) over the embedding group (first and last pipeline stage).

    Both stages must mark their copy of the tied weight with ``shared_embedding=True``.
    """
    if pg_collection.pp.size == 1 or not pg_collection.in_embedding_group:
        return
    # (a shared embedding has a bucket of its own: the same shard pieces on both stages)
    grads = [_grad(c, p) for c, p in _unique_params(model_chunks)
             if getattr(p, "shared_embedding", False) and _grad(c, p) is not None]
    _allreduce_coalesced(grads, pg_collection.embedding.group)


def global_token_count(num_tokens, pg_collection: ProcessGroupCollection,
                       device=None) -> torch.Tensor:
    """The global batch's loss tokens, as per-token loss divides by them: ``num_tokens`` (this
    rank's last pipeline stage's sum over its micro-batches; ignored on other stages) broadcast
    from the last stage and summed over the data x context-parallel group. A 0-dim fp64 tensor.

    Collectives: pipeline broadcast, data x context-parallel all-reduce (groups of one: none)."""
    total = torch.as_tensor(num_tokens, dtype=torch.float64, device=device).clone().reshape(())
    pp, dp_cp = pg_collection.pp, pg_collection.dp_cp
    if pp.size > 1:
        dist.broadcast(total, src=pp.ranks[-1], group=pp.group)
    if dp_cp.size > 1:
        dist.all_reduce(total, group=dp_cp.group)
    return total


def finalize_model_grads(model_chunks: List[torch.nn.Module], *,
                         num_tokens: Optional[Union[torch.Tensor, int]] = None,
                         pg_collection: ProcessGroupCollection) -> None:
    """Finish the gradient reductions of one iteration (see the module docstring for the steps).

    Args:
        model_chunks: the model chunks of this rank, normally
            :class:`~megatron.core.distributed.DistributedDataParallel` wrappers (plain modules are
            accepted: their ``param.grad`` is used and no data-parallel reduction happens).
        num_tokens: per-token loss only (``--calculate-per-token-loss``): the number of loss
            tokens this rank's last pipeline stage summed over its micro-batches (any value on
            other stages; it is broadcast from the last stage). Gradients end divided by the total
            over the whole global batch.
        pg_collection: this rank's process groups (required; the schedules receive this function
            with it bound, e.g. ``functools.partial(finalize_model_grads, pg_collection=...)``).

    Collectives: data-parallel all-reduce per bucket; tensor-parallel and embedding-group
    all-reduces when those parameters exist; pipeline broadcast and data x context-parallel
    all-reduce of ``num_tokens``.
    """
    for chunk in model_chunks:
        if isinstance(chunk, DistributedDataParallel):
            chunk.finish_grad_sync()
    _allreduce_sequence_parallel_grads(model_chunks, pg_collection)
    _allreduce_embedding_grads(model_chunks, pg_collection)

    if num_tokens is None:
        return
    device = next(iter(_unique_params(model_chunks)))[1].device
    total = global_token_count(num_tokens, pg_collection, device)
    if total.item() <= 0:
        raise ValueError(f"finalize_model_grads: the global batch has {total.item():g} loss tokens; "
                         "with --calculate-per-token-loss at least one unmasked token is needed")
    # DDP already averaged the summed gradients (1/DP): undone, so the result is sum over
    # ranks / total tokens.
    for chunk in model_chunks:
        if isinstance(chunk, DistributedDataParallel):
            chunk.divide_gradients_by_tokens(total.item())
        else:
            for p in chunk.parameters():
                if p.grad is not None:
                    p.grad.div_(total.item())
