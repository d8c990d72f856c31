"""OLMoE's full-width q/k RMSNorm split over tensor ranks (``FullWidthRMSNorm``): at TP=2 each
rank's slice of the output, of the input gradient and of the weight gradient equals the
single-process RMSNorm over the whole width (the sum of squares all-reduced in fp32, its
gradient summed over the ranks); at TP=1 it is ``RMSNorm`` bitwise."""

import torch

from megatron.core import parallel_state as ps
from megatron.model.full_width_qk_norm import FullWidthRMSNorm
from megatron.model.rms_norm import RMSNorm
from tests.helpers.dist import run_distributed

S, B, W, EPS = 5, 2, 24, 1e-6


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, W, generator=gen) * 3
    weight = 1 + 0.1 * torch.randn(W, generator=gen)
    upstream = torch.randn(S, B, W, generator=gen)
    return x, weight, upstream


def _reference():
    x, weight, upstream = _inputs()
    norm = RMSNorm(W, EPS)
    with torch.no_grad():
        norm.weight.copy_(weight)
    x.requires_grad_(True)
    y = norm(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, norm.weight.grad


def _rank(tp):
    groups = ps.initialize_model_parallel(tp, 1)
    r, w = groups.tp.rank, W // tp
    x, weight, upstream = _inputs()
    part = slice(r * w, (r + 1) * w)
    norm = FullWidthRMSNorm(W, groups.tp.group, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(weight[part])
    x = x[..., part].clone().requires_grad_(True)
    # The loss's part through this rank's slice only, as a rank's heads see it
    y = norm(x)
    (y * upstream[..., part]).sum().backward()
    return (y.detach(), x.grad, norm.weight.grad,
            getattr(norm.weight, "tensor_model_parallel", False),
            getattr(norm.weight, "sequence_parallel", False))


def test_tp2_slices_equal_the_whole_width_norm():
    y, dx, dw = _reference()
    for r, (y_r, dx_r, dw_r, partitioned, sp) in enumerate(run_distributed(2, _rank, 2)):
        part = slice(r * W // 2, (r + 1) * W // 2)
        torch.testing.assert_close(y_r, y[..., part], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dx_r, dx[..., part], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dw_r, dw[part], rtol=1e-6, atol=1e-6)
        assert partitioned and not sp  # sharded with the heads: no gradient all-reduce
    # the slices without the all-reduce would not match: the test has teeth
    x, _, _ = _inputs()
    half = RMSNorm(W // 2, EPS)(x[..., :W // 2]).detach()
    assert (half - y[..., :W // 2] / _inputs()[1][:W // 2]).abs().max() > 1e-2


def test_tp1_is_rmsnorm_bitwise():
    y, dx, dw = _reference()
    y1, dx1, dw1, partitioned, _ = run_distributed(1, _rank, 1)[0]
    assert torch.equal(y1, y) and torch.equal(dx1, dx) and torch.equal(dw1, dw)
    assert not partitioned
