"""linear_cross_entropy (output layer + cross entropy fused, in-place buffer) equals F.linear + the
plain vocab_parallel_cross_entropy: loss and the gradients of hidden and weight, at TP=1 (fused
softmax kernel, exact log-sum-exp for far targets) and TP=2 (several row chunks per rank), with
and without label smoothing."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import fused_cross_entropy
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.fused_cross_entropy import linear_cross_entropy
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from tests.helpers.dist import run_distributed

S, B, H, V = 7, 3, 8, 64


def _inputs():
    torch.manual_seed(3)
    hidden = torch.randn(S, B, H)
    weight = torch.randn(V, H) * 2.0  # sharp softmax: targets matter
    target = torch.randint(0, V, (S, B))
    target.view(-1)[:8] = torch.arange(0, V, V // 8)  # every partition holds some target
    return hidden, weight, target, torch.randn(S, B)


def _both(hidden, weight, target, dy, smoothing, group):
    """(loss, d hidden, d weight) of the plain and of the fused path."""
    out = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        x = copy_to_tensor_model_parallel_region(h, group)
        if fused:
            with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
                loss = linear_cross_entropy(x, w, target, smoothing, tp_group=group)
            # the max, then the target logits, the sums of exponentials (and of logits) in one
            assert all_reduce.call_count == (0 if group is None else 2)
        else:
            loss = vocab_parallel_cross_entropy(F.linear(x, w).float(), target, smoothing,
                                                tp_group=group)
        loss.backward(dy)
        out.append((loss.detach(), h.grad, w.grad))
    return out


def _assert_equal(plain, fused, dtype=torch.float32):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, a, b in zip(("loss", "d hidden", "d weight"), plain, fused):
        assert b.dtype == a.dtype, name
        torch.testing.assert_close(b, a, msg=name, **tol)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fused_equals_plain_single_process(smoothing):
    hidden, weight, target, dy = _inputs()
    plain, fused = _both(hidden, weight, target, dy, smoothing, None)
    _assert_equal(plain, fused)
    assert plain[0].abs().max() > 1.0  # far from uniform


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fused_bf16_and_big_logits(smoothing):
    hidden, weight, target, dy = _inputs()
    # exp() overflows unshifted, and most targets' probabilities underflow fp32 (loss > 69 nats):
    # their loss comes from the recomputed log-sum-exp, not from log(softmax).
    # A few targets are the most likely token (loss about 0), to mix both kinds of rows.
    weight = weight * 1e3
    target[0] = (hidden[0] @ weight.t()).argmax(-1)
    plain, fused = _both(hidden, weight, target, dy, smoothing, None)
    assert torch.isfinite(fused[0]).all()
    assert (plain[0] > 100).float().mean() > 0.5
    assert smoothing > 0 or (plain[0][0] < 1).all()
    _assert_equal(plain, fused)
    plain, fused = _both(hidden.bfloat16(), weight.bfloat16(), target, dy, 0.0, None)
    assert fused[0].dtype == torch.float32 and fused[1].dtype == torch.bfloat16
    _assert_equal(plain, fused, torch.bfloat16)


def test_second_backward_and_bad_input_raise():
    hidden, weight, target, _ = _inputs()
    h = hidden.clone().requires_grad_(True)
    loss = linear_cross_entropy(h, weight, target, tp_group=None).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(hidden, weight, target, 1.0, tp_group=None)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(hidden, weight[:, :4], target, tp_group=None)


def _tp_world(tp):
    tp_group = ps.initialize_model_parallel(tp, 1).tp
    rank = tp_group.rank
    fused_cross_entropy._CHUNK_BYTES = 3 * (V // tp) * 4  # several chunks per rank
    hidden, weight, target, dy = _inputs()
    for smoothing in (0.0, 0.1):
        plain, fused = _both(hidden, weight.chunk(tp)[rank].contiguous(), target, dy, smoothing,
                             tp_group.group)
        _assert_equal(plain, fused)
    return fused  # smoothing 0.1, compared with one process by the caller


def test_fused_tp2_equals_tp1():
    hidden, weight, target, dy = _inputs()
    ref_loss, ref_dh, ref_dw = _both(hidden, weight, target, dy, 0.1, None)[0]
    results = run_distributed(2, _tp_world, 2)
    for rank, (loss, dh, dw) in enumerate(results):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dh, ref_dh, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dw, ref_dw.chunk(2)[rank], rtol=1e-5, atol=1e-5)


def _tp2_fp16_big_vocab():
    tp_group = ps.initialize_model_parallel(2, 1).tp
    rank = tp_group.rank
    torch.manual_seed(5)
    vocab = 131072  # near-uniform logits: the sum of exponentials exceeds fp16's 65504
    hidden = torch.randn(6, 8) * 0.1
    weight = torch.randn(vocab, 8) * 0.01
    target = torch.randint(0, vocab, (6,))
    out = {}
    for dtype in (torch.float32, torch.float16):
        h = hidden.to(dtype).clone().requires_grad_(True)
        w = weight.chunk(2)[rank].to(dtype).clone().requires_grad_(True)
        loss = linear_cross_entropy(copy_to_tensor_model_parallel_region(h, tp_group.group), w,
                                    target, tp_group=tp_group.group)
        loss.sum().backward()
        out[dtype] = (loss.detach(), h.grad.float(), w.grad.float())
    return out


def test_fused_fp16_tp2_big_vocabulary_gradients_stay_finite():
    for out in run_distributed(2, _tp2_fp16_big_vocab):
        ref, half = out[torch.float32], out[torch.float16]
        for name, a, b in zip(("loss", "d hidden", "d weight"), ref, half):
            assert torch.isfinite(b).all(), name
            torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-3, msg=name)
