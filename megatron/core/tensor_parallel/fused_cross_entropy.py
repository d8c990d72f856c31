"""Output layer and vocabulary-parallel cross entropy fused: one fp32 ``[tokens, v/TP]`` buffer.

The unfused path (``F.linear`` then :func:`vocab_parallel_cross_entropy`) materialises the
logits, a shifted copy, their exponentials and, in backward, a copy of the softmax: four
``[tokens, v/TP]`` fp32 tensors and about eight memory passes over them. Over a 32k vocabulary
those element-wise passes cost as much as the transformer layers of a small model on a CPU.
Here the logits are computed once (one matrix product, as before) and then turned *in place*
into what backward needs: on CPU at TP = 1 the softmax, by torch's fused row-wise kernel (one
exponential per element; a ``log_softmax`` would need a second one in backward); otherwise
(TP > 1, where the max is all-reduced before the exponentials and their sums after, or CUDA) the
unnormalised ``exp(z - max)``, in a few row chunks on CPU. Backward turns the buffer into the logits' gradient in place (in fp32 up to a
per-row factor that the ``[N, h]`` operand and result of the output layer's two products take
instead; in bf16/fp16, whose cast would overflow on unnormalised entries, exactly); the weight's
product goes straight into ``main_grad`` under gradient-accumulation fusion. The same idea as
Liger-Kernel's fused linear cross entropy and Megatron-Core's
``fused_vocab_parallel_cross_entropy``, without recomputing the logits.

The loss, label smoothing, reductions over the tensor-parallel group and the exclusion of the
vocabulary padding (its logits set to -inf in the buffer right after the product, so the padding
adds nothing to the loss and gets zero gradient) are those of
:mod:`megatron.core.tensor_parallel.cross_entropy` (Megatron-LM's ``_VocabParallelCrossEntropy``).

Shapes: N = tokens (any leading dims flattened), h = hidden, v = padded vocabulary, T = TP size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.process_groups import group_rank, group_size
from megatron.core.tensor_parallel.cross_entropy import (check_vocab_size, local_target,
                                                        mask_padding, real_columns, sum_over_ranks)
from megatron.core.tensor_parallel.grad_accumulation import accumulator_of, linear_weight_grad
from megatron.core.tensor_parallel.mappings import all_reduce

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


class _BufferPool:
    """Free ``[N, v/T]`` fp32 buffers kept for the next micro-batch, on CPU only.

    A buffer this large (64 MiB for 512 tokens of a 32k vocabulary) is above glibc's mmap
    threshold: freed, it goes back to the system, and the next micro-batch's logits product
    writes into fresh pages the kernel must fault in and zero (measured: 50 ms instead of 32 ms
    for ``[512, 256] @ [256, 32000]`` on a 2-core machine). The pool holds only buffers no graph
    uses any more (returned at the end of backward, or of a forward without backward); a graph
    dropped before its backward simply lets its buffer be freed. CUDA's caching allocator already
    reuses device memory, so CUDA buffers are never pooled.
    """

    def __init__(self, max_free_per_shape: int = 2):
        self.max_free_per_shape = max_free_per_shape
        self._free = {}

    def acquire(self, rows: int, cols: int, device) -> torch.Tensor:
        free = self._free.get((rows, cols, device))
        if free:
            return free.pop()
        return torch.empty(rows, cols, dtype=torch.float32, device=device)

    def release(self, buf: torch.Tensor) -> None:
        if buf.device.type != "cpu":
            return
        free = self._free.setdefault((buf.size(0), buf.size(1), buf.device), [])
        if len(free) < self.max_free_per_shape:
            free.append(buf)


_POOL = _BufferPool()


class _LinearVocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, target, label_smoothing, group, gradient_accumulation_fusion,
                true_vocab_size):
        world, rank = group_size(group), group_rank(group)
        buf = _POOL.acquire(hidden.size(0), weight.size(0), hidden.device)
        if hidden.dtype == torch.float32:
            torch.mm(hidden, weight.t(), out=buf)
        else:
            buf.copy_(torch.mm(hidden, weight.t()))
        partition_vocab_size = buf.size(-1)
        vocab_size = partition_vocab_size * world if true_vocab_size is None else true_vocab_size
        real = real_columns(partition_vocab_size, rank, true_vocab_size)
        mask_padding(buf, real)
        target_mask, masked_target = local_target(target, partition_vocab_size, rank, world)
        if world == 1 and not buf.is_cuda:
            # CPU only: the rare-row check below syncs with the host, which a GPU step must not.
            loss = _softmax_in_place(buf, hidden, weight[:real], target, label_smoothing, real)
            sum_exp = None
        else:
            loss, sum_exp = _shifted_exp_in_place(buf, masked_target, target_mask, label_smoothing,
                                                  vocab_size, real, group)
        ctx.label_smoothing, ctx.vocab_size, ctx.consumed = label_smoothing, vocab_size, False
        ctx.real = real
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(hidden, weight, buf, sum_exp, target_mask, masked_target)
        else:
            _POOL.release(buf)
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
        # d loss / d z = g * (softmax - (1 - s) onehot(target) - s / K)  (s = 0 without smoothing),
        # softmax = buf / c with c = 1 (TP = 1: buf is the softmax) or c = sum_exp.
        c = torch.ones_like(g) if sum_exp is None else sum_exp
        if hidden.dtype == torch.float32:
            # The per-row factor g / c goes onto the [N, h] operand and result of the two
            # products instead of the [N, v/T] buffer: one pass over the buffer less.
            row_scale, unit = (g / c).unsqueeze(-1), c
        else:
            # Low precision: the buffer is cast, so it must hold the gradient itself (|entries|
            # <= |g|); unnormalised entries (-c at the target, c up to v) would overflow fp16.
            buf.mul_((g / c).unsqueeze(-1))
            row_scale, unit = None, g
        target_weight = -unit * (~target_mask).to(unit.dtype)
        if ctx.label_smoothing > 0:
            smoothing = ctx.label_smoothing * ctx.vocab_size / (ctx.vocab_size - 1)
            buf[:, :ctx.real].sub_((unit * (smoothing / ctx.vocab_size)).unsqueeze(-1))
            target_weight = target_weight * (1.0 - smoothing)
        buf.scatter_add_(-1, masked_target.unsqueeze(-1), target_weight.unsqueeze(-1))
        grad_logits = buf.to(hidden.dtype)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = grad_logits.matmul(weight)
            if row_scale is not None:
                grad_hidden.mul_(row_scale)
        if ctx.needs_input_grad[1]:
            grad_weight = linear_weight_grad(
                weight, grad_logits, hidden if row_scale is None else hidden * row_scale,
                ctx.gradient_accumulation_fusion, accumulator_of(ctx, 1))
        del grad_logits
        _POOL.release(buf)
        return grad_hidden, grad_weight, None, None, None, None, None


# Below this probability of the target (a loss above 69 nats) -log(p) is taken from a recomputed
# log-sum-exp instead: p may be denormal or zero in fp32.
_TINY_PROBABILITY = 1e-30


def _softmax_in_place(buf, hidden, real_weight, target, label_smoothing, real):
    """TP = 1: turn the logits ``buf`` (padding columns from ``real`` on already -inf) into the
    softmax in place with torch's fused row-wise kernel (one exponential per element, each row
    re-read from cache) and return the per-token loss ``-log p[target]`` (with label smoothing,
    ``(1 - s) (lse - z_t) - s (mean z - lse)``, the mean over the ``real`` columns);
    ``real_weight``: the output layer's real rows ``[real, h]``."""
    vocab_size = real
    index = target.unsqueeze(-1)
    target_logit = buf.gather(-1, index).squeeze(-1)
    mean_logit = buf[:, :real].mean(dim=-1) if label_smoothing > 0 else None
    torch.softmax(buf, dim=-1, out=buf)
    p = buf.gather(-1, index).squeeze(-1)
    log_sum_exp = target_logit - p.log()
    far = (p < _TINY_PROBABILITY).nonzero().squeeze(-1)
    if far.numel():  # rare: recompute those rows' logits and their log-sum-exp exactly
        rows = hidden.index_select(0, far).matmul(real_weight.t()).float()
        log_sum_exp[far] = torch.logsumexp(rows, dim=-1)
    loss = log_sum_exp - target_logit
    if mean_logit is not None:
        smoothing = label_smoothing * vocab_size / (vocab_size - 1)
        loss = (1.0 - smoothing) * loss - smoothing * (mean_logit - log_sum_exp)
    return loss


def _shifted_exp_in_place(buf, masked_target, target_mask, label_smoothing, vocab_size, real,
                          group):
    """Turn the logits ``buf`` into ``exp(z - max)`` (the max over the whole vocabulary) in row
    chunks; return the per-token loss and the sums of the exponentials (both all-reduced).
    ``vocab_size``: the true vocabulary K; ``real``: this rank's real columns (the others are
    -inf: their exponentials are zero)."""
    world = group_size(group)
    rows = buf.size(0)
    # one all-reduce for the target logits, the sums of exponentials and the sums of logits
    sums = buf.new_empty(3 if label_smoothing > 0 else 2, rows)
    predicted, sum_exp = sums[0], sums[1]
    sum_shifted = sums[2] if label_smoothing > 0 else None
    if world > 1:  # the shift must be the global max before any exp()
        logits_max = all_reduce(buf.amax(dim=-1), group, op=dist.ReduceOp.MAX)
    begin = 0
    for chunk in _row_chunks(buf):
        end_row = begin + chunk.size(0)
        m = chunk.amax(dim=-1) if world == 1 else logits_max[begin:end_row]
        chunk.sub_(m.unsqueeze(-1))
        predicted[begin:end_row] = chunk.gather(-1, masked_target[begin:end_row].unsqueeze(-1)).squeeze(-1)
        if sum_shifted is not None:
            sum_shifted[begin:end_row] = chunk[:, :real].sum(dim=-1)
        chunk.exp_()
        sum_exp[begin:end_row] = chunk.sum(dim=-1)
        begin = end_row
    predicted.masked_fill_(target_mask, 0.0)
    sums = sum_over_ranks(sums, group)
    predicted, sum_exp = sums[0], sums[1]
    log_sum_exp = sum_exp.log()
    loss = log_sum_exp - predicted
    if sum_shifted is not None:
        smoothing = label_smoothing * vocab_size / (vocab_size - 1)
        mean_log_probs = sums[2] / vocab_size - log_sum_exp
        loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
    return loss, sum_exp


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         label_smoothing: float = 0.0, *, tp_group,
                         gradient_accumulation_fusion: bool = True,
                         vocab_size: Optional[int] = None) -> torch.Tensor:
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
        tp_group: the tensor-parallel group the vocabulary is split over (None: a world of one).
        gradient_accumulation_fusion: accumulate the weight gradient straight into
            ``weight.main_grad`` when it has one (see
            :mod:`megatron.core.tensor_parallel.grad_accumulation`).
        vocab_size: the true vocabulary K (``ModelConfig.true_vocab_size``): the rows of
            ``weight`` from K on (over all ranks) are padding, excluded from the loss; their
            gradient is zero. None: every row is real.

    Returns:
        loss ``[...]`` fp32 (unreduced). Backward may run once per forward (it reuses the buffer
        in place; a second backward through ``retain_graph=True`` raises RuntimeError).

    Raises:
        ValueError: ``label_smoothing`` outside ``[0, 1)``, shapes that disagree, or a
            ``vocab_size`` above the padded vocabulary.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing ({label_smoothing}) must be in [0, 1)")
    if hidden.shape[:-1] != target.shape or hidden.size(-1) != weight.size(-1):
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and target "
                         f"{tuple(target.shape)}: need hidden [..., h], weight [v/T, h], target [...]")
    check_vocab_size(vocab_size, weight.size(0), tp_group)
    lead = target.shape
    loss = _LinearVocabParallelCrossEntropy.apply(
        hidden.reshape(-1, hidden.size(-1)), weight, target.reshape(-1), float(label_smoothing),
        tp_group, gradient_accumulation_fusion, vocab_size)
    return loss.view(lead)
