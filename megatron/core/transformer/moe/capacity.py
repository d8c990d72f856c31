"""Expert capacity and token dropping, decided on the micro-batch's whole token set.

Megatron-Core drops over the local shard's tokens, so which tokens are dropped changes with the
tensor/sequence/context split. Here the shards' routing decisions (``[T_local, k]`` indices and
probabilities: small) are gathered over the token group first, the drops are chosen on the whole
set and each shard keeps its rows of the answer, so every layout drops the same tokens.

The whole set's order is the shards' concatenation in group-rank order, ``[s, b]`` flattened
sequence-major inside a shard (so a sequence-parallel split gives the true order; under context
parallelism's load-balanced split ``position`` ranks by that fixed permutation of the sequence).
"""

from __future__ import annotations

import math

import torch

from megatron.core.process_groups import group_rank, group_size
from megatron.core.tensor_parallel.mappings import all_gather_first_dim

DROP_POLICIES = ("probs", "position")


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, topk: int) -> int:
    """Rows each expert takes from the whole set: ``ceil(N k / E x factor)`` (Megatron-Core's
    ``get_capacity`` on the N k choices)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def keep_mask(indices: torch.Tensor, probs: torch.Tensor, num_experts: int, capacity: int,
              policy: str) -> torch.Tensor:
    """``[T, k]`` bool: the choices an expert keeps when it takes at most ``capacity`` of them.

    ``probs``: an expert keeps its ``capacity`` most probable choices (ties: earlier token, then
    earlier slot). ``position``: its first ``capacity`` choices in token order.

    Args:
        indices: ``[T, k]`` int64 expert of each choice. probs: ``[T, k]`` their probabilities.

    Raises:
        ValueError: an unknown policy.
    """
    if policy not in DROP_POLICIES:
        raise ValueError(f"--moe-token-drop-policy {policy}: use one of {DROP_POLICIES}")
    flat = indices.reshape(-1)
    order = torch.arange(flat.numel(), device=flat.device)
    if policy == "probs":
        # Descending probability, stable so that equal probabilities keep token order.
        order = torch.sort(probs.reshape(-1).detach(), descending=True, stable=True).indices
    by_expert = order[torch.sort(flat[order], stable=True).indices]
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[by_expert]]
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[by_expert] = rank_in_expert < capacity
    return keep.view(indices.shape)


def whole_set_keep_mask(indices: torch.Tensor, probs: torch.Tensor, num_experts: int,
                        capacity_factor: float, policy: str, token_group):
    """This shard's ``[T_local, k]`` keep mask and the capacity, decided on the whole set.

    Args:
        indices, probs: ``[T_local, k]`` of this shard (every shard holds as many tokens).
        token_group: the group over which the micro-batch's tokens are split (None: one shard).

    Returns:
        ``(keep [T_local, k] bool, capacity int)``.
    """
    shards = group_size(token_group)
    all_indices = all_gather_first_dim(indices.contiguous(), token_group)
    all_probs = all_gather_first_dim(probs.detach().contiguous(), token_group)
    capacity = get_capacity(all_indices.shape[0], num_experts, capacity_factor, indices.shape[1])
    keep = keep_mask(all_indices, all_probs, num_experts, capacity, policy)
    local = indices.shape[0]
    rank = group_rank(token_group) if shards > 1 else 0
    return keep[rank * local:(rank + 1) * local], capacity
