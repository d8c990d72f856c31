"""Active FLOPs of a mixture-of-experts model (megatron.model.flops), against torch's own count
of an MoELayer's forward matmuls (torch.utils.flop_counter) and the dense formula."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.model.flops import moe_layers, num_floating_point_operations
from tests.unit.model.test_model import small_config

MOE = MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=6,
                moe_shared_expert_intermediate_size=4)


def test_mlp_term_is_torchs_count_of_the_routed_and_shared_experts():
    c = dataclasses.replace(small_config(), num_layers=1)
    h, s, b = c.hidden_size, 5, 2
    layer = MoELayer(MOE, hidden_size=h, seed=1, layer_number=1)
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(s, b, h))
    router = 2 * s * b * h * MOE.num_experts  # [T, h] x [h, E]: not counted (Megatron-LM's rule)
    counted = counter.get_total_flops() - router
    no_mlp = dataclasses.replace(c, ffn_hidden_size=0)
    formula = (num_floating_point_operations(c, b, s, MOE)
               - num_floating_point_operations(no_mlp, b, s)) / 3  # forward only
    assert formula == pytest.approx(counted, rel=1e-12)
    assert counted > 0


def test_dense_model_and_layer_pattern():
    c = small_config()
    layers = c.num_layers
    assert num_floating_point_operations(c, 2, 8, None) == \
        num_floating_point_operations(c, 2, 8, MoEConfig())
    assert moe_layers(MoEConfig(num_experts=4, moe_layer_freq=2), 4) == [True, False, True, False]
    pattern = tuple(int(i == 0) for i in range(layers))
    one = dataclasses.replace(MOE, moe_layer_freq=pattern)
    dense, every = (num_floating_point_operations(c, 2, 8, m) for m in (None, MOE))
    # one MoE layer of `layers`: 1/layers of the way from dense to all-MoE
    assert num_floating_point_operations(c, 2, 8, one) == pytest.approx(
        dense + (every - dense) / layers, rel=1e-12)
    with pytest.raises(ValueError, match="--moe-layer-freq has 1 entries"):
        moe_layers(dataclasses.replace(MOE, moe_layer_freq=(1,)), layers)


def test_log_line_counts_mixtral_as_a_dense_model_of_its_active_width():
    """Mixtral-8x7B's shape, top-2 of 8 experts of 14336: the log line's FLOPs are a dense
    model's with a 2 x 14336 MLP (what each token passes through), not 8 x."""
    import argparse

    from megatron.config import ModelConfig
    from megatron.training import train

    shape = dict(hidden_size=4096, num_layers=32, num_attention_heads=32, num_query_groups=8,
                 kv_channels=128, padded_vocab_size=32000, max_position_embeddings=4096)
    moe = MoEConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336)
    config = argparse.Namespace(model=ModelConfig(ffn_hidden_size=14336, **shape), moe=moe,
                                data=argparse.Namespace(seq_length=4096))
    dense = ModelConfig(ffn_hidden_size=2 * 14336, **shape)
    assert train.num_floating_point_operations(config, 3) == pytest.approx(
        num_floating_point_operations(dense, 3, 4096), rel=1e-12)
