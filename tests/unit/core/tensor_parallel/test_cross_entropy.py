"""vocab_parallel_cross_entropy equals the dense cross entropy: loss and logits gradient."""

import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.helpers.dist import run_distributed

S, B, V = 6, 3, 16


def _dense_loss(logits, target, label_smoothing):
    """Megatron's smoothed cross entropy written out over the full vocabulary:
    (1 - alpha) * nll + alpha / (K - 1) * sum over non-target classes of -log p."""
    log_p = F.log_softmax(logits.float(), dim=-1)
    nll = -log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if label_smoothing == 0:
        return nll
    k = logits.size(-1)
    others = -(log_p.sum(-1)) - nll
    return (1 - label_smoothing) * nll + label_smoothing / (k - 1) * others


def _inputs(scale):
    torch.manual_seed(5)
    logits = torch.randn(S, B, V) * scale
    logits[0, 0] += 1e4  # exp() would overflow without the max subtraction
    target = torch.randint(0, V, (S, B))
    target.view(-1)[:V] = torch.arange(V)  # every vocabulary partition holds some target
    return logits, target, torch.randn(S, B)


def _check(logits, target, dy, label_smoothing, chunk, tp_group=None):
    ref_logits = logits.clone().requires_grad_(True)
    ref = _dense_loss(ref_logits, target, label_smoothing)
    ref.backward(dy)
    par_logits = chunk(logits).clone().requires_grad_(True)
    before = par_logits.detach().clone()
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        loss = vocab_parallel_cross_entropy(par_logits, target, label_smoothing,
                                            tp_group=tp_group)
    # the max, then the target logits, the sums of exponentials (and of logits) in one
    assert all_reduce.call_count == (0 if tp_group is None else 2)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    loss.backward(dy)
    torch.testing.assert_close(par_logits.grad, chunk(ref_logits.grad), rtol=1e-5, atol=1e-6)
    assert torch.equal(par_logits.detach(), before), "the caller's logits were modified"


def _ce_world(tp):
    tp_group = ps.initialize_model_parallel(tp, 1).tp
    rank, group = tp_group.rank, tp_group.group

    def chunk(t):
        return t.chunk(tp, dim=-1)[rank]

    for scale in (1.0, 30.0):
        logits, target, dy = _inputs(scale)
        for label_smoothing in (0.0, 0.1):
            _check(logits, target, dy, label_smoothing, chunk, group)
    # bf16 logits: fp32 loss equal to the fp32 loss of the same (rounded) values
    logits, target, dy = _inputs(1.0)
    bf16 = chunk(logits.bfloat16()).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(bf16, target, tp_group=group)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, _dense_loss(logits.bfloat16(), target, 0.0), rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    assert bf16.grad.dtype == torch.bfloat16
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_equals_dense(tp):
    assert run_distributed(tp, _ce_world, tp) == [True] * tp


def test_single_process_matches_torch():
    logits, target, dy = _inputs(1.0)
    _check(logits, target, dy, 0.0, lambda t: t)
    _check(logits, target, dy, 0.2, lambda t: t)
    # without smoothing this is exactly torch's cross entropy
    torch.testing.assert_close(
        vocab_parallel_cross_entropy(logits, target, tp_group=None),
        F.cross_entropy(logits.view(-1, V), target.view(-1), reduction="none").view(S, B))
    # uniform logits: loss = ln(V) whatever the smoothing
    flat = vocab_parallel_cross_entropy(torch.zeros(1, 1, V), torch.zeros(1, 1, dtype=torch.long),
                                        0.3, tp_group=None)
    assert math.isclose(flat.item(), math.log(V), rel_tol=1e-6)


def test_errors():
    logits, target, _ = _inputs(1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, target, 1.0, tp_group=None)
    with pytest.raises(ValueError, match="agree"):
        vocab_parallel_cross_entropy(logits, target[:-1], tp_group=None)
