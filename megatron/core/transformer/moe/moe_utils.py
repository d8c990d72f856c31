"""The router's losses and their backward: load balancing (switch, sequence, global), z-loss.

Every loss is defined on a token set that does not depend on the layout, and is computed as a
sum of *parts*, one per shard of that set: the part of a shard is a function of its own tokens'
scores and of counts reduced over the whole set, and the parts sum to the loss. The gradient of the
loss with respect to a shard's scores is therefore the gradient of its part; summing the router's
weight gradients over the shards (as sequence-parallel norm weights are) gives the gradient of the
whole loss, whatever the split. Notation: N tokens in the set, E experts, k experts per token,
``c`` the coefficient, ``f_e`` the number of tokens that chose expert e (before capacity),
``P_e`` the sum over the set of the tokens' normalised scores for e.

Backward: :class:`MoEAuxLossAutoScaler` (Megatron-Core's pattern) attaches a part to the layer's
output, so the part's gradient enters backward when the output's does, on every pipeline stage,
without the loss being returned through the model. The gradient injected is ``scale`` (a tensor
the layer holds, :func:`set_aux_loss_scale`): 1 for a loss added once to a micro-batch's loss
that is itself not divided; the schedule's division by the number of micro-batches M, or the
per-token loss's, is reproduced by setting it to that factor (Megatron-Core sets ``1/M``).
"""

from __future__ import annotations

import contextlib

import torch

from megatron.core.tensor_parallel.mappings import all_reduce


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Forward: ``output`` unchanged. Backward: ``output``'s gradient unchanged, and ``scale``
    (0-dim tensor) as the gradient of ``aux_loss`` (a 0-dim tensor with a graph to the router).
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor):
        ctx.save_for_backward(aux_loss, scale)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        aux_loss, scale = ctx.saved_tensors
        return grad_output, scale.to(aux_loss.dtype) * torch.ones_like(aux_loss), None


def load_balancing_part(scores: torch.Tensor, counts: torch.Tensor, num_tokens: int, topk: int,
                        coeff: float) -> torch.Tensor:
    """``c E / (k N^2) sum_e f_e P_e^local``: this shard's part of the switch-transformer loss
    (Fedus et al. 2021, eq. 4, Megatron-Core's ``switch_load_balancing_loss_func``).

    Args:
        scores: ``[T_local, E]`` normalised scores of this shard's tokens (softmax, or sigmoid
            divided by its row sum), fp32 or fp64, with their graph.
        counts: ``[E]`` tokens per expert over the whole set (no graph).
        num_tokens: N, the tokens of the whole set.
        topk: k. coeff: c.

    Returns:
        a 0-dim tensor in ``scores``' dtype. A balanced router (``f_e = N k / E``,
        ``P_e = N / E``) gives ``c``.
    """
    num_experts = scores.shape[-1]
    factor = coeff * num_experts / (topk * float(num_tokens) ** 2)
    return (scores.sum(0) * counts.to(scores.dtype)).sum() * factor


def sequence_load_balancing_part(scores: torch.Tensor, counts: torch.Tensor, seq_length: int,
                                 topk: int, coeff: float) -> torch.Tensor:
    """This shard's part of the sequence-wise loss (DeepSeek-V2/V3, Megatron-Core's
    ``sequence_load_balancing_loss_func``): the mean over the b sequences of
    ``c E / (k S^2) sum_e f_{b,e} P_{b,e}``.

    Args:
        scores: ``[s_local, b, E]`` normalised scores of this shard's tokens.
        counts: ``[b, E]`` tokens of each whole sequence per expert (no graph).
        seq_length: S, the whole sequence's length (all shards).

    Returns:
        a 0-dim tensor; 0-dim ``c`` for a balanced router.
    """
    num_experts = scores.shape[-1]
    batch = scores.shape[1]
    factor = coeff * num_experts / (topk * float(seq_length) ** 2 * batch)
    return (scores.sum(0) * counts.to(scores.dtype)).sum() * factor


def z_loss_part(logits: torch.Tensor, num_tokens: int, coeff: float) -> torch.Tensor:
    """This shard's part of the router z-loss (Zoph et al. 2022, ST-MoE eq. 5):
    ``c / N sum_t logsumexp(logits_t)^2``.

    Args:
        logits: ``[T_local, E]`` router logits (fp32/fp64) with their graph.
        num_tokens: N, the tokens of the whole micro-batch.
    """
    return torch.logsumexp(logits, dim=-1).square().sum() * (coeff / num_tokens)


def tokens_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64: how many of the ``[T, k]`` choices ``indices`` name each expert."""
    return torch.bincount(indices.reshape(-1), minlength=num_experts)


def reduce_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` summed over ``group`` (None: a world of one), no graph."""
    return all_reduce(counts, group)


def updated_expert_bias(expert_bias: torch.Tensor, counts: torch.Tensor,
                        update_rate: float) -> torch.Tensor:
    """Aux-loss-free balancing's update (Wang et al. 2024, Megatron-Core's
    ``get_updated_expert_bias``): ``b_e + rate * sign(mean(counts) - counts_e)``.

    Args:
        expert_bias: ``[E]`` fp32. counts: ``[E]`` tokens per expert over the whole batch.
    """
    counts = counts.to(expert_bias.dtype)
    return expert_bias + torch.sign(counts.mean() - counts) * update_rate


_COUNTING = [False]


@contextlib.contextmanager
def counting_pass():
    """Within it, MoE layers only count their choices for ``global_aux_loss``
    (:mod:`megatron.training.moe_global_counts`): no loss, no logged figure, no expert-bias
    count."""
    _COUNTING[0] = True
    try:
        yield
    finally:
        _COUNTING[0] = False


def is_counting_pass() -> bool:
    """True inside :func:`counting_pass`."""
    return _COUNTING[0]


def set_aux_loss_scale(model: torch.nn.Module, scale: float) -> None:
    """Set the gradient every MoE layer of ``model`` injects for its losses (see the module)."""
    for name, buffer in model.named_buffers():
        if name.rsplit(".", 1)[-1] == "aux_loss_scale":  # each MoE layer's own buffer
            buffer.fill_(scale)
