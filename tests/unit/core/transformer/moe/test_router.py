"""The router against transformers' routers, and the whole layer against their MoE blocks, on the
same weights (transformers 5: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, Llama 4)."""

import pytest
import torch

from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe.router import group_limited_topk, route
from tests.unit.core.transformer.moe.hf_blocks import FAMILIES, H, hf_route, our_layer


def _sorted(indices, probs):
    order = indices.argsort(dim=-1)
    return indices.gather(1, order), probs.gather(1, order)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_router_matches_transformers(family):
    make, arg = FAMILIES[family]
    block, config = make(arg)
    layer = our_layer(block, config)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hf_indices, hf_probs = _sorted(*hf_route(block, x))
        _, probs, indices = layer.router(x)
        indices, probs = _sorted(indices, probs)
    assert torch.equal(indices, hf_indices)
    assert probs.dtype == torch.float32
    if family != "deepseek_v3":  # the same operations in the same order: the same bits
        assert torch.equal(probs, hf_probs.float())
    # DeepSeek-V3 sums the k in another order (transformers' topk(sorted=False)): within 1e-7
    # before --moe-router-topk-scaling-factor (2.5), measured 1.2e-7 after it.
    scale = config.moe_router_topk_scaling_factor or 1.0
    torch.testing.assert_close(probs, hf_probs.float(), rtol=0, atol=1e-7 * scale)


@pytest.mark.parametrize("grouped_gemm", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layer_matches_transformers_block(family, grouped_gemm):
    make, arg = FAMILIES[family]
    block, config = make(arg)
    layer = our_layer(block, config, grouped_gemm).eval()
    x = torch.randn(5, 3, H, generator=torch.Generator().manual_seed(8))  # [s, b, h]
    with torch.no_grad():
        ours = layer(x)
        hf = block(x.transpose(0, 1).contiguous())
        hf = (hf[0] if isinstance(hf, tuple) else hf).reshape(3, 5, H).transpose(0, 1)
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=1e-6)  # measured <= 8e-8 of max|out|


def test_group_limited_topk_closed_form():
    # 2 tokens, 4 groups of 2 experts; group score = sum of its top-1 (k=2, 2 groups).
    scores = torch.tensor([[0.9, 0.0, 0.1, 0.1, 0.8, 0.0, 0.7, 0.6],
                           [0.0, 0.1, 0.5, 0.5, 0.4, 0.45, 0.9, 0.0]])
    idx = group_limited_topk(scores, topk=2, num_groups=4, group_topk=2).sort(-1).values
    assert idx.tolist() == [[0, 4], [3, 6]] or idx.tolist() == [[0, 4], [2, 6]]
    # token 1: groups (0.1, 0.5, 0.45, 0.9) -> groups 1 and 3: experts 2/3 (0.5 tie) and 6.


def test_pre_softmax_and_renormalised_softmax_and_scaling():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    full = torch.softmax(logits, -1)
    cfg = MoEConfig(num_experts=4, moe_router_topk=2, moe_router_pre_softmax=True)
    probs, idx = route(logits, cfg)
    assert idx.tolist() == [[0, 1]] and torch.equal(probs, full[:, :2])
    cfg = MoEConfig(num_experts=4, moe_router_topk=2, moe_router_topk_scaling_factor=3.0)
    probs, _ = route(logits, cfg)
    torch.testing.assert_close(probs, 3 * full[:, :2] / full[:, :2].sum(), rtol=1e-15, atol=0)


def test_sigmoid_bias_changes_choice_not_probability():
    logits = torch.tensor([[1.0, 0.5, 0.0]])
    cfg = MoEConfig(num_experts=3, moe_router_topk=1, moe_router_score_function="sigmoid")
    bias = torch.tensor([0.0, 0.0, 2.0])
    probs, idx = route(logits, cfg, bias)
    assert idx.tolist() == [[2]] and probs.item() == torch.sigmoid(torch.tensor(0.0)).item()
    probs, idx = route(logits, cfg, None)
    assert idx.tolist() == [[0]] and probs.item() == torch.sigmoid(torch.tensor(1.0)).item()


def test_router_dtype_fp64():
    from tests.unit.core.transformer.moe.hf_blocks import mixtral
    block, config = mixtral()
    import dataclasses
    layer = our_layer(block, dataclasses.replace(config, moe_router_dtype="fp64"))
    x = torch.randn(8, H)
    logits, probs, _ = layer.router(x)
    assert logits.dtype == probs.dtype == torch.float64
    torch.testing.assert_close(logits, x.double() @ layer.router.weight.double().T)
