"""Capacity and token dropping: closed forms of the keep mask, padding changes nothing, dropped
choices contribute nothing."""

import pytest
import torch

from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.moe.capacity import get_capacity, keep_mask


def test_get_capacity():
    assert get_capacity(num_tokens=10, num_experts=4, capacity_factor=1.0, topk=2) == 5
    assert get_capacity(num_tokens=10, num_experts=4, capacity_factor=1.1, topk=2) == 6
    assert get_capacity(num_tokens=3, num_experts=8, capacity_factor=1.0, topk=1) == 1


def test_keep_mask_policies():
    # 4 tokens, k = 1, all to expert 0, capacity 2.
    indices = torch.zeros(4, 1, dtype=torch.long)
    probs = torch.tensor([[0.1], [0.9], [0.5], [0.7]])
    assert keep_mask(indices, probs, 2, 2, "position").view(-1).tolist() == [True, True, False, False]
    assert keep_mask(indices, probs, 2, 2, "probs").view(-1).tolist() == [False, True, False, True]
    # ties keep token order
    flat = torch.full((4, 1), 0.5)
    assert keep_mask(indices, flat, 2, 3, "probs").view(-1).tolist() == [True, True, True, False]
    with pytest.raises(ValueError, match="--moe-token-drop-policy"):
        keep_mask(indices, probs, 2, 2, "random")


def test_keep_mask_per_expert_with_topk_two():
    indices = torch.tensor([[0, 1], [1, 0], [0, 1]])
    probs = torch.tensor([[0.6, 0.4], [0.8, 0.2], [0.7, 0.3]])
    keep = keep_mask(indices, probs, 2, 2, "probs")
    # expert 0: probs 0.6 (t0), 0.2 (t1), 0.7 (t2) -> keeps t0, t2; expert 1: 0.4, 0.8, 0.3 -> t0, t1
    assert keep.tolist() == [[True, True], [True, False], [True, False]]


def _layer(**kw):
    cfg = MoEConfig(num_experts=4, moe_router_topk=2, **kw)
    return MoELayer(cfg, hidden_size=8, ffn_hidden_size=6, seed=2, layer_number=3,
                    init_method_std=0.5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_dropped_choices_contribute_nothing_and_padding_changes_nothing(policy):
    x = torch.randn(6, 2, 8)
    dropless = _layer()
    dropping = _layer(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy)
    padded = _layer(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy,
                    moe_pad_expert_input_to_capacity=True)
    out = dropping(x)
    assert dropping.dropped_choices > 0
    assert torch.equal(padded(x), out)
    assert padded.tokens_per_expert.tolist() == [3] * 4  # capacity ceil(12 * 2 / 4 * 0.5)
    # the oracle: each kept choice's expert output times its probability, summed in fp32
    flat = x.view(-1, 8)
    _, probs, indices = dropless.router(flat)
    from megatron.core.transformer.moe.capacity import keep_mask
    keep = keep_mask(indices, probs, 4, 3, policy)
    ref = torch.zeros_like(flat)
    w1, w2 = dropless.experts.weight1, dropless.experts.weight2
    for t in range(flat.shape[0]):
        for j in range(2):
            if keep[t, j]:
                e = indices[t, j]
                g, u = (w1[e] @ flat[t]).chunk(2)
                ref[t] += probs[t, j] * (w2[e] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(out.view(-1, 8), ref, rtol=1e-5, atol=1e-6)
