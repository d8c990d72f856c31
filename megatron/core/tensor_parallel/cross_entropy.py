"""Cross entropy over vocabulary-parallel logits, without gathering the vocabulary.

Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``
(``_VocabParallelCrossEntropy``); label smoothing as Megatron / NeMo's smoothed cross entropy:
the smoothing mass ``alpha`` is spread over the K-1 non-target classes, i.e.

    loss = (1 - s) * (-log p_target) - s * mean_i(log p_i),   s = alpha * K / (K - 1)

where K is the true vocabulary. Everything is computed in fp32. Each rank holds logits
``[..., v/TP]`` for the rows ``[r * v/TP, (r+1) * v/TP)``; two all-reduces over the
tensor-parallel group give the exact full-vocabulary loss: the max, then the target logit, the
sum of exponentials and (label smoothing) the sum of logits stacked into one (Megatron-LM issues
one per quantity: three, four with smoothing; each is a latency-bound collective of a few
floats per token).

Vocabulary padding (``--make-vocab-size-divisible-by`` x TP rows beyond the tokenizer's ``K``)
is excluded: the padding columns' logits are taken as -inf, so they add nothing to the
log-sum-exp (nor to the smoothing mean) and their gradient is exactly zero. The loss is then the
same whatever the padding, and equals a softmax over the true vocabulary (what HuggingFace
computes).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.process_groups import group_rank, group_size
from megatron.core.tensor_parallel.mappings import all_reduce
from megatron.core.tensor_parallel.utils import VocabUtility


def real_columns(partition_vocab_size: int, rank: int, vocab_size) -> int:
    """How many of this rank's ``partition_vocab_size`` vocabulary columns are real ids (the
    first ones; the rest is padding) for a true vocabulary of ``vocab_size`` (None: all)."""
    if vocab_size is None:
        return partition_vocab_size
    return max(0, min(partition_vocab_size, vocab_size - rank * partition_vocab_size))


def check_vocab_size(vocab_size, partition_vocab_size: int, group) -> None:
    """Raise ValueError unless ``vocab_size`` (None, or the true vocabulary) fits the padded
    vocabulary ``partition_vocab_size x TP``."""
    padded = partition_vocab_size * group_size(group)
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size ({vocab_size}) must be in [1, {padded}], the padded "
                         "vocabulary of the logits")


def mask_padding(logits: torch.Tensor, real: int) -> torch.Tensor:
    """``logits [..., v/TP]`` with the columns from ``real`` on set to -inf, in place."""
    if real < logits.size(-1):
        logits[..., real:] = float("-inf")
    return logits


def sum_over_ranks(sums: torch.Tensor, group) -> torch.Tensor:
    """``sums [q, ...]`` (the per-rank partial sums of ``q`` quantities, stacked) summed over
    ``group`` in one all-reduce, out of place; ``sums`` itself at one rank."""
    return sums if group_size(group) == 1 else all_reduce(sums, group)


def local_target(target: torch.Tensor, partition_vocab_size: int, rank: int, world: int):
    """Where ``target`` ids fall outside this rank's vocabulary slice, and the ids within it.

    Returns:
        ``(target_mask, masked_target)``: bool mask (True = another rank holds the id) and the ids
        shifted into ``[0, partition_vocab_size)`` (0 where masked), both shaped like ``target``.
    """
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        partition_vocab_size, rank, world)
    target_mask = (target < start) | (target >= end)
    return target_mask, (target - start).masked_fill(target_mask, 0)


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, group, true_vocab_size):
        world, rank = group_size(group), group_rank(group)
        partition_vocab_size = vocab_parallel_logits.size(-1)
        vocab_size = partition_vocab_size * world if true_vocab_size is None else true_vocab_size
        real = real_columns(partition_vocab_size, rank, true_vocab_size)
        logits = vocab_parallel_logits.float()
        if real < partition_vocab_size:  # a copy: the caller's logits are untouched
            logits = mask_padding(logits.clone(), real)
        # Subtracting the global max keeps exp() in range (numerical stability); out of place,
        # so the caller's logits are untouched.
        logits_max = all_reduce(logits.max(dim=-1)[0], group, op=dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)

        target_mask, masked_target = local_target(target, partition_vocab_size, rank, world)

        predicted_logits = logits.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1)
        exp_logits = logits.exp()
        partial = [predicted_logits.masked_fill(target_mask, 0.0), exp_logits.sum(dim=-1)]
        if label_smoothing > 0:
            partial.append(logits[..., :real].sum(dim=-1))
        sums = sum_over_ranks(torch.stack(partial), group)
        predicted_logits, sum_exp_logits = sums[0], sums[1]
        log_sum_exp = sum_exp_logits.log()
        loss = log_sum_exp - predicted_logits

        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            # mean_i log p_i = mean_i z_i - log sum exp z, computed in log space (no log(0)) and
            # over the full vocabulary (sum of z over all ranks: sums[2]).
            mean_log_probs = sums[2] / vocab_size - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))
        ctx.label_smoothing, ctx.vocab_size, ctx.real = label_smoothing, vocab_size, real
        ctx.save_for_backward(softmax, target_mask, masked_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target = ctx.saved_tensors
        # d loss / d z = softmax - (1 - s) * onehot(target) - s / K   (s = 0 without smoothing)
        grad_input = softmax.clone()  # the saved softmax stays valid for retain_graph=True
        on_rank = (~target_mask).to(grad_input.dtype).unsqueeze(-1)
        if ctx.label_smoothing > 0:
            smoothing = ctx.label_smoothing * ctx.vocab_size / (ctx.vocab_size - 1)
            grad_input.scatter_add_(-1, masked_target.unsqueeze(-1), -(1.0 - smoothing) * on_rank)
            grad_input[..., :ctx.real].sub_(smoothing / ctx.vocab_size)  # padding: zero
        else:
            grad_input.scatter_add_(-1, masked_target.unsqueeze(-1), -on_rank)
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, tp_group,
                                 vocab_size: Optional[int] = None) -> torch.Tensor:
    """Per-token cross entropy of vocabulary-parallel logits (unreduced).

    Args:
        vocab_parallel_logits: ``[s, b, v/TP]`` (any leading dims), any float dtype; this rank's
            vocabulary partition. Not modified.
        target: ``[s, b]`` int64 token ids in ``[0, v)`` (the full vocabulary).
        label_smoothing: Megatron's smoothing ``alpha`` in ``[0, 1)`` (see the module docstring).
        tp_group: the tensor-parallel group the vocabulary is split over (None: a world of one).
        vocab_size: the true vocabulary K (``ModelConfig.true_vocab_size``): columns from K on
            are padding and excluded (module docstring). None: every column is real.

    Returns:
        loss ``[s, b]`` fp32. Backward gives the logits' gradient in fp32 (autograd casts it to
        the logits' dtype); zero in the padding columns.

    Raises:
        ValueError: if ``label_smoothing`` is outside ``[0, 1)``, the shapes disagree or
            ``vocab_size`` exceeds the padded vocabulary.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing ({label_smoothing}) must be in [0, 1)")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(vocab_parallel_logits.shape)} and target "
                         f"{tuple(target.shape)} must agree on all but the last dimension")
    check_vocab_size(vocab_size, vocab_parallel_logits.size(-1), tp_group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing),
                                            tp_group, vocab_size)
