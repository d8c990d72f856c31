"""Output layer and vocabulary-parallel cross entropy fused: one fp32 ``[tokens, v/TP]`` buffer.

The unfused path (``F.linear`` then :func:`vocab_parallel_cross_entropy`) materialises the
logits, a shifted copy, their exponentials and, in backward, a copy of the softmax: four
``[tokens, v/TP]`` fp32 tensors and about eight memory passes over them. Over a 32k vocabulary
those element-wise passes cost as much as the transformer layers of a small model on a CPU.
Here the logits are computed once (one matrix product, as before) and then, in a few row
chunks, shifted, exponentiated and summed *in place*; the buffer (unnormalised
``exp(z - max)``, each exponential computed once: torch's fused ``log_softmax`` was measured
slower here, as backward must then exponentiate again) is what backward needs, and backward turns
it into the logits' gradient in place (one scaling pass and a scatter at the targets) before the
two matrix products of the output layer's backward; the weight's product goes straight into
``main_grad`` under gradient-accumulation fusion. The same idea as Liger-Kernel's fused linear
cross entropy and Megatron-Core's ``fused_vocab_parallel_cross_entropy``, without recomputing the
logits.

The loss, label smoothing and reductions over the tensor-parallel group are those of
:mod:`megatron.core.tensor_parallel.cross_entropy` (Megatron-LM's ``_VocabParallelCrossEntropy``).

Shapes: N = tokens (any leading dims flattened), h = hidden, v = padded vocabulary, T = TP size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.cross_entropy import local_target
from megatron.core.tensor_parallel.grad_accumulation import linear_weight_grad
from megatron.core.tensor_parallel.mappings import all_reduce
from megatron.core.tensor_parallel.utils import (group_rank, group_world_size,
                                                 resolve_tensor_parallel_group)

# Row chunks of at most this many bytes. Cache-sized chunks (about 1 MiB) were measured slower on
# a loaded 2-core machine: each small op pays the thread pool's synchronisation, which dominates
# once cores are shared; a few large chunks keep the op count low.
_CHUNK_BYTES = 16 << 20


def _row_chunks(buf: torch.Tensor):
    if buf.is_cuda:  # one pass each: a GPU kernel streams the whole tensor anyway
        yield buf
        return
    rows = max(1, _CHUNK_BYTES // (buf.size(-1) * buf.element_size()))
    yield from buf.split(rows)


class _LinearVocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, target, label_smoothing, group, gradient_accumulation_fusion):
        world, rank = group_world_size(group), group_rank(group)
        logits = torch.matmul(hidden, weight.t())
        buf = logits if logits.dtype == torch.float32 else logits.float()
        del logits
        partition_vocab_size = buf.size(-1)
        vocab_size = partition_vocab_size * world
        target_mask, masked_target = local_target(target, partition_vocab_size, rank, world)
        loss, sum_exp = _shifted_exp_in_place(buf, masked_target, target_mask, label_smoothing,
                                              vocab_size, group)
        ctx.label_smoothing, ctx.vocab_size, ctx.consumed = label_smoothing, vocab_size, False
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.save_for_backward(hidden, weight, buf, sum_exp, target_mask, masked_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.consumed:
            raise RuntimeError("linear_cross_entropy: backward ran twice through the same graph "
                               "(retain_graph=True); its buffer is turned into the gradient in "
                               "place. Run the forward again, or use F.linear + "
                               "vocab_parallel_cross_entropy for double backward")
        ctx.consumed = True
        hidden, weight, buf, sum_exp, target_mask, masked_target = ctx.saved_tensors
        g = grad_output.float()
        # d loss / d z = softmax - (1 - s) * onehot(target) - s / K   (s = 0 without smoothing),
        # times the incoming gradient; softmax = buf / sum_exp.
        buf.mul_((g / sum_exp).unsqueeze(-1))
        target_weight = -g * (~target_mask).to(g.dtype)
        if ctx.label_smoothing > 0:
            smoothing = ctx.label_smoothing * ctx.vocab_size / (ctx.vocab_size - 1)
            buf.sub_((g * (smoothing / ctx.vocab_size)).unsqueeze(-1))
            target_weight = target_weight * (1.0 - smoothing)
        buf.scatter_add_(-1, masked_target.unsqueeze(-1), target_weight.unsqueeze(-1))
        grad_logits = buf.to(hidden.dtype)
        grad_hidden = grad_logits.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = linear_weight_grad(weight, grad_logits, hidden,
                                             ctx.gradient_accumulation_fusion)
        return grad_hidden, grad_weight, None, None, None, None


def _shifted_exp_in_place(buf, masked_target, target_mask, label_smoothing, vocab_size, group):
    """Turn the logits ``buf`` into ``exp(z - max)`` (the max over the whole vocabulary) in row
    chunks; return the per-token loss and the sums of the exponentials (both all-reduced)."""
    world = group_world_size(group)
    rows = buf.size(0)
    predicted = buf.new_empty(rows)
    sum_exp = buf.new_empty(rows)
    sum_shifted = buf.new_empty(rows) if label_smoothing > 0 else None
    if world > 1:  # the shift must be the global max before any exp()
        logits_max = all_reduce(buf.amax(dim=-1), group, op=dist.ReduceOp.MAX)
    begin = 0
    for chunk in _row_chunks(buf):
        end_row = begin + chunk.size(0)
        m = chunk.amax(dim=-1) if world == 1 else logits_max[begin:end_row]
        chunk.sub_(m.unsqueeze(-1))
        predicted[begin:end_row] = chunk.gather(-1, masked_target[begin:end_row].unsqueeze(-1)).squeeze(-1)
        if sum_shifted is not None:
            sum_shifted[begin:end_row] = chunk.sum(dim=-1)
        chunk.exp_()
        sum_exp[begin:end_row] = chunk.sum(dim=-1)
        begin = end_row
    predicted = all_reduce(predicted.masked_fill_(target_mask, 0.0), group)
    sum_exp = all_reduce(sum_exp, group)
    log_sum_exp = sum_exp.log()
    loss = log_sum_exp - predicted
    if sum_shifted is not None:
        smoothing = label_smoothing * vocab_size / (vocab_size - 1)
        mean_log_probs = all_reduce(sum_shifted, group) / vocab_size - log_sum_exp
        loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
    return loss, sum_exp


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         label_smoothing: float = 0.0, group=None,
                         gradient_accumulation_fusion: bool = True) -> torch.Tensor:
    """Per-token cross entropy of ``hidden @ weight.T`` over a vocabulary-parallel output layer.

    Equals ``vocab_parallel_cross_entropy(F.linear(hidden, weight).float(), target, ...)`` (same
    loss, same gradients within fp32 rounding) while keeping one fp32 ``[N, v/T]`` buffer instead
    of four. The caller applies the tensor-parallel input mapping first
    (``copy_to_tensor_model_parallel_region``: its backward all-reduces the input gradient).

    Args:
        hidden: ``[..., h]`` (fp32 or bf16/fp16), identical on every tensor-parallel rank.
        weight: ``[v/T, h]``, this rank's vocabulary rows, the dtype of ``hidden``.
        target: ``[...]`` int64 token ids in ``[0, v)`` (the full vocabulary).
        label_smoothing: Megatron's smoothing ``alpha`` in ``[0, 1)``.
        group: tensor-parallel group (None: the registry's).
        gradient_accumulation_fusion: accumulate the weight gradient straight into
            ``weight.main_grad`` when it has one (see
            :mod:`megatron.core.tensor_parallel.grad_accumulation`).

    Returns:
        loss ``[...]`` fp32 (unreduced). Backward may run once per forward (it reuses the buffer
        in place; a second backward through ``retain_graph=True`` raises RuntimeError).

    Raises:
        ValueError: ``label_smoothing`` outside ``[0, 1)``, or shapes that disagree.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing ({label_smoothing}) must be in [0, 1)")
    if hidden.shape[:-1] != target.shape or hidden.size(-1) != weight.size(-1):
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and target "
                         f"{tuple(target.shape)}: need hidden [..., h], weight [v/T, h], target [...]")
    lead = target.shape
    loss = _LinearVocabParallelCrossEntropy.apply(
        hidden.reshape(-1, hidden.size(-1)), weight, target.reshape(-1), float(label_smoothing),
        resolve_tensor_parallel_group(group), gradient_accumulation_fusion)
    return loss.view(lead)
