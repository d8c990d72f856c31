"""Vocabulary padding never enters the loss: the fused (linear_cross_entropy) and the unfused
(vocab_parallel_cross_entropy) cross entropy over a padded output layer equal a softmax over the
true vocabulary computed in fp64, with and without label smoothing, at TP=1 and TP=2 (one
rank holding real and padding rows, or padding only), whatever values the padding rows hold;
the padding rows get exactly zero gradient."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.fused_cross_entropy import linear_cross_entropy
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from tests.helpers.dist import run_distributed

S, B, H, PADDED = 5, 3, 8, 64
# true vocabularies: 61 (rank 1 of TP=2 holds 29 real rows and 3 padding rows), 30 (rank 1 holds
# padding only)
VOCABS = (61, 30)


def _inputs(vocab):
    g = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(S, B, H, generator=g)
    weight = torch.randn(PADDED, H, generator=g) * 2.0
    # Padding rows as a foreign checkpoint may hold them: large, so that they would dominate a
    # softmax that let them in.
    weight[vocab:] = 50.0 * torch.randn(PADDED - vocab, H, generator=g)
    target = torch.randint(0, vocab, (S, B), generator=g)
    return hidden, weight, target, torch.randn(S, B, generator=g)


def _reference(hidden, weight, target, dy, vocab, smoothing):
    """fp64 loss, d hidden and d weight of a softmax over the first ``vocab`` rows only."""
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    log_p = F.log_softmax(F.linear(h, w[:vocab]), dim=-1)
    nll = -log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    s = smoothing * vocab / (vocab - 1)  # Megatron's smoothing over the K - 1 other ids
    loss = (1 - s) * nll - s * log_p.mean(dim=-1)
    loss.backward(dy.double())
    return loss.detach().float(), h.grad.float(), w.grad.float()


def _ours(hidden, weight, target, dy, vocab, smoothing, fused, group):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    x = copy_to_tensor_model_parallel_region(h, group)
    if fused:
        loss = linear_cross_entropy(x, w, target, smoothing, tp_group=group, vocab_size=vocab)
    else:
        loss = vocab_parallel_cross_entropy(F.linear(x, w), target, smoothing, tp_group=group,
                                            vocab_size=vocab)
    loss.backward(dy)
    return loss.detach(), h.grad, w.grad


CASES = [(vocab, smoothing, fused) for vocab in VOCABS for smoothing in (0.0, 0.1)
         for fused in (False, True)]


def _world(tp):
    tp_group = ps.initialize_model_parallel(tp, 1).tp if tp > 1 else None
    rank = 0 if tp_group is None else tp_group.rank
    out = []
    for vocab, smoothing, fused in CASES:
        hidden, weight, target, dy = _inputs(vocab)
        out.append(_ours(hidden, weight.chunk(tp)[rank].contiguous(), target, dy, vocab,
                         smoothing, fused, None if tp_group is None else tp_group.group))
    return out


def _check(results, tp):
    for rank, per_case in enumerate(results):
        for (vocab, smoothing, fused), (loss, dh, dw) in zip(CASES, per_case):
            hidden, weight, target, dy = _inputs(vocab)
            ref_loss, ref_dh, ref_dw = _reference(hidden, weight, target, dy, vocab, smoothing)
            name = f"TP={tp} rank {rank} vocab {vocab} smoothing {smoothing} fused {fused}"
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(dh, ref_dh, rtol=1e-5, atol=1e-5, msg=name)
            # (the reference's padding rows never enter its softmax: their gradient is zero)
            torch.testing.assert_close(dw, ref_dw.chunk(tp)[rank], rtol=1e-5, atol=1e-5, msg=name)
            pad_from = max(0, vocab - rank * (PADDED // tp))
            assert torch.count_nonzero(dw[pad_from:]) == 0, name


def test_padding_is_excluded_single_process():
    _check([_world(1)], 1)


def test_padding_is_excluded_tp2():
    _check(run_distributed(2, _world, 2), 2)


def test_without_the_mask_the_padding_changes_the_loss_and_bad_sizes_raise():
    hidden, weight, target, _ = _inputs(61)
    masked = linear_cross_entropy(hidden, weight, target, tp_group=None, vocab_size=61)
    unmasked = linear_cross_entropy(hidden, weight, target, tp_group=None)
    assert (unmasked - masked).abs().max() > 1.0  # the check above has teeth
    for bad in (0, PADDED + 1):
        with pytest.raises(ValueError, match="vocab_size"):
            linear_cross_entropy(hidden, weight, target, tp_group=None, vocab_size=bad)
        with pytest.raises(ValueError, match="vocab_size"):
            vocab_parallel_cross_entropy(F.linear(hidden, weight), target, tp_group=None,
                                         vocab_size=bad)
