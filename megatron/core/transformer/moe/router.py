"""The top-k router (Megatron-Core's ``TopKRouter``): logits, scores, the k experts of each token
and their probabilities, the losses it records and the aux-loss-free expert bias.

Flag recipes reproducing the transformers routers are in docs/moe.md and tested against them:
Mixtral (softmax, renormalised), Qwen2/3-MoE and OLMoE (``--moe-router-pre-softmax`` when
``norm_topk_prob`` is false), DeepSeek-V3 (sigmoid, expert bias, groups, scaling), Llama 4 (top-1
sigmoid, probabilities on the expert input).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.random import is_recomputing
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe.moe_utils import (is_counting_pass, reduce_counts,
                                                     updated_expert_bias)

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int,
                       group_topk: int) -> torch.Tensor:
    """``[T, k]`` indices of the top-k experts among each token's best ``group_topk`` groups
    (DeepSeek-V2/V3's node-limited routing, Megatron-Core's ``group_limited_topk``).

    A group's score is the sum of its ``k / group_topk`` best experts' scores; experts outside the
    chosen groups are masked with ``-inf``.

    Args:
        scores: ``[T, E]`` the routing scores (with the expert bias where it is on).
    """
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(-1)
    chosen = group_scores.topk(group_topk, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    mask = mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return scores.masked_fill(~mask, float("-inf")).topk(topk, dim=-1).indices


def _topk(scores: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    if config.moe_router_num_groups:
        return group_limited_topk(scores, config.moe_router_topk, config.moe_router_num_groups,
                                  config.moe_router_group_topk)
    return scores.topk(config.moe_router_topk, dim=-1).indices


def route(logits: torch.Tensor, config: MoEConfig,
          expert_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k experts of each token and their probabilities (Megatron-Core's
    ``topk_softmax_with_capacity`` without the capacity, which is decided on the whole set).

    softmax: with ``moe_router_pre_softmax`` the top-k of ``softmax(logits)`` over all E, else the
    top-k of the logits with ``softmax(logits)`` renormalised over the k (Megatron-Core's softmax of
    the k top logits, computed as transformers' Mixtral/Qwen do, so the bits match theirs). sigmoid: the top-k of
    ``sigmoid(logits) + expert_bias`` (bias for the choice only), probabilities
    ``sigmoid(logits)`` of those, divided by their sum when k > 1. Then times
    ``moe_router_topk_scaling_factor``.

    Args:
        logits: ``[T, E]`` fp32 or fp64.
        expert_bias: ``[E]`` or None.

    Returns:
        ``(probs [T, k] logits' dtype, indices [T, k] int64)``.
    """
    k = config.moe_router_topk
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            indices = _topk(scores, config)
            probs = scores.gather(1, indices)
        else:
            # The k of softmax(logits) divided by their sum: the softmax of the k top logits
            # (Megatron-Core's form) up to rounding, in transformers' order of operations.
            indices = _topk(logits, config)
            probs = torch.softmax(logits, dim=-1).gather(1, indices)
            probs = probs / probs.sum(-1, keepdim=True)
    else:
        scores = torch.sigmoid(logits)
        choice = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
        indices = _topk(choice, config)
        probs = scores.gather(1, indices)
        if k > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    if config.moe_router_topk_scaling_factor is not None:
        probs = probs * config.moe_router_topk_scaling_factor
    return probs, indices


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """``[T, E]`` the normalised scores the load-balancing losses read: ``softmax(logits)``, or
    ``sigmoid(logits)`` divided by its row sum (Megatron-Core's rule for sigmoid routers)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(-1, keepdim=True) + 1e-20)


class TopKRouter(torch.nn.Module):
    """``weight [E, h]`` (the gate), ``expert_bias [E]`` fp32 (a saved buffer, with
    ``--moe-router-enable-expert-bias``) and ``local_tokens_per_expert [E]`` (choices counted
    since the last bias update, not saved).

    Args:
        config: the MoE section. hidden_size: h.
        params_dtype / device: of ``weight``; its values are drawn by the caller (the layer
            seeds it from ``(seed, layer, "mlp.router")``).
    """

    def __init__(self, config: MoEConfig, hidden_size: int, *, params_dtype=torch.float32,
                 device=None):
        super().__init__()
        self.config = config
        experts = config.num_experts
        self.weight = torch.nn.Parameter(torch.empty(experts, hidden_size, dtype=params_dtype,
                                                     device=device))
        self.router_dtype = ROUTER_DTYPES.get(config.moe_router_dtype)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32,
                                                            device=device))
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(experts, dtype=torch.float32, device=device),
                                 persistent=False)
        else:
            self.expert_bias = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, h] -> [T, E]`` in the router dtype (fp32 when none is set: the linear runs in
        the input's dtype, its result is cast)."""
        if self.router_dtype is not None:
            return F.linear(x.to(self.router_dtype), self.weight.to(self.router_dtype))
        return F.linear(x, self.weight).float()

    def forward(self, x: torch.Tensor):
        """``x [T, h]`` -> ``(logits [T, E], probs [T, k], indices [T, k])``; in training with
        the expert bias on, the choices are added to ``local_tokens_per_expert``."""
        logits = self.logits(x)
        probs, indices = route(logits, self.config, self.expert_bias)
        if self.expert_bias is not None and self.training and not (is_recomputing()
                                                                   or is_counting_pass()):
            with torch.no_grad():
                self.local_tokens_per_expert += torch.bincount(
                    indices.reshape(-1), minlength=self.config.num_experts).float()
        return logits, probs, indices

    @torch.no_grad()
    def update_expert_bias(self, group) -> None:
        """Once per iteration, after the last micro-batch: sum the counted choices over
        ``group`` (every rank whose tokens make the batch: TP x CP x DP, with EP folded in), apply
        the sign rule (:func:`~megatron.core.transformer.moe.moe_utils.updated_expert_bias`) and
        reset the counts. Every rank of ``group`` ends with the same bias."""
        if self.expert_bias is None:
            return
        counts = reduce_counts(self.local_tokens_per_expert, group)
        self.expert_bias.copy_(updated_expert_bias(self.expert_bias, counts,
                                                   self.config.moe_router_bias_update_rate))
        self.local_tokens_per_expert.zero_()
