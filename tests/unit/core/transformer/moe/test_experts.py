"""Grouped experts: torch._grouped_mm against the per-expert loop and against plain per-expert
SwiGLU math; initialisation per (seed, layer, expert)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.moe.experts import GroupedMLP

KW = dict(seed=3, layer_number=2, init_method_std=0.2, num_layers=2)


def _pair(dtype, experts=4, first=0):
    loop = GroupedMLP(experts, 16, 8, first_expert=first, params_dtype=dtype, **KW)
    grouped = GroupedMLP(experts, 16, 8, first_expert=first, params_dtype=dtype,
                         grouped_gemm=True, **KW)
    assert grouped.grouped_gemm and not loop.grouped_gemm
    return loop, grouped


def _run(module, x, counts):
    x = x.clone().requires_grad_()
    y = module(x, counts)
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
    return y, x.grad, module.weight1.grad, module.weight2.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_loop_bitwise_on_cpu(dtype):
    loop, grouped = _pair(dtype)
    counts = torch.tensor([3, 0, 7, 2])  # a zero-row expert
    x = torch.randn(12, 16).to(dtype)
    for a, b in zip(_run(loop, x, counts), _run(grouped, x, counts)):
        assert torch.equal(a, b)  # measured: the same bits (torch 2.13, CPU)


def test_loop_is_per_expert_swiglu():
    loop, _ = _pair(torch.float32)
    counts = torch.tensor([2, 3, 0, 1])
    x = torch.randn(6, 16)
    y = loop(x, counts)
    rows = torch.split(x, counts.tolist())
    ref = []
    for e, r in enumerate(rows):
        gate, up = F.linear(r, loop.weight1[e]).chunk(2, dim=-1)
        ref.append(F.linear(F.silu(gate) * up, loop.weight2[e]))
    torch.testing.assert_close(y, torch.cat(ref), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_no_rows_gives_zero_weight_gradients(grouped_gemm):
    m = GroupedMLP(2, 16, 8, first_expert=0, grouped_gemm=grouped_gemm, **KW)
    y = m(torch.zeros(0, 16, requires_grad=True), torch.tensor([0, 0]))
    y.sum().backward()
    assert y.shape == (0, 16)
    assert torch.equal(m.weight1.grad, torch.zeros_like(m.weight1))


def test_fp64_takes_the_loop():
    assert not GroupedMLP(2, 16, 8, first_expert=0, grouped_gemm=True,
                          params_dtype=torch.float64, **KW).grouped_gemm


def test_expert_weights_do_not_depend_on_the_split():
    whole = GroupedMLP(4, 16, 8, first_expert=0, **KW)
    half = GroupedMLP(2, 16, 8, first_expert=2, **KW)
    assert torch.equal(whole.weight1[2:], half.weight1)
    assert torch.equal(whole.weight2[2:], half.weight2)
    assert not torch.equal(whole.weight1[0], whole.weight1[1])


def test_widths_the_kernel_refuses_take_the_loop():
    # _grouped_mm wants row strides that are multiples of 16 bytes: f = 6 fp32 is 24 bytes.
    assert not GroupedMLP(2, 16, 6, first_expert=0, grouped_gemm=True, **KW).grouped_gemm
    assert GroupedMLP(2, 16, 8, first_expert=0, grouped_gemm=True, **KW).grouped_gemm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_in_half_precision_grouped_equals_loop_and_tracks_fp32(dtype):
    from megatron.core.transformer.moe.moe_config import MoEConfig
    from megatron.core.transformer.moe import MoELayer

    def layer(params_dtype, grouped):
        cfg = MoEConfig(num_experts=4, moe_router_topk=2, moe_grouped_gemm=grouped,
                        moe_router_dtype="fp32", moe_shared_expert_intermediate_size=16)
        return MoELayer(cfg, hidden_size=16, ffn_hidden_size=16, seed=5, layer_number=1,
                        init_method_std=0.2, params_dtype=params_dtype)

    x = torch.randn(6, 2, 16)
    loop, grouped = layer(dtype, False), layer(dtype, True)
    assert grouped.experts.grouped_gemm
    out = grouped(x.to(dtype))
    assert out.dtype == dtype and torch.equal(out, loop(x.to(dtype)))
    torch.testing.assert_close(out.float(), layer(torch.float32, False)(x), rtol=0.05, atol=0.02)


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_expert_tensor_parallel_slices_sum_to_the_whole_expert(grouped_gemm):
    """Expert-TP 2: rank r holds rows ``[gate_r; up_r]`` of weight1 and columns ``f_r`` of
    weight2 of the whole expert (drawn whole, so independent of the split); the two ranks'
    partial outputs sum to the whole experts' output, and their weight gradients are the slices
    of the whole gradients."""
    whole = GroupedMLP(2, 16, 8, first_expert=2, grouped_gemm=grouped_gemm, **KW)
    parts = [GroupedMLP(2, 16, 8, first_expert=2, grouped_gemm=grouped_gemm, tp_rank=r,
                        tp_size=2, **KW) for r in (0, 1)]
    gate, up = whole.weight1.detach().chunk(2, dim=1)
    for r, part in enumerate(parts):
        cols = slice(4 * r, 4 * r + 4)
        assert torch.equal(part.weight1, torch.cat([gate[:, cols], up[:, cols]], 1))
        assert torch.equal(part.weight2, whole.weight2[:, :, cols])
        assert part.weight1.tensor_model_parallel and part.weight2.partition_dim == 2
    counts = torch.tensor([5, 0])
    x = torch.randn(5, 16)
    y, dx, dw1, dw2 = _run(whole, x, counts)
    got = [_run(part, x, counts) for part in parts]
    torch.testing.assert_close(got[0][0] + got[1][0], y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0][1] + got[1][1], dx, rtol=1e-6, atol=1e-6)
    dgate, dup = dw1.chunk(2, dim=1)
    for r, (_, _, g1, g2) in enumerate(got):
        cols = slice(4 * r, 4 * r + 4)
        torch.testing.assert_close(g1, torch.cat([dgate[:, cols], dup[:, cols]], 1))
        torch.testing.assert_close(g2, dw2[:, :, cols])
    with pytest.raises(ValueError, match=r"\(8\) must be divisible by --expert-tensor-parallel-size \(3\)"):
        GroupedMLP(2, 16, 8, first_expert=0, tp_rank=0, tp_size=3, **KW)
