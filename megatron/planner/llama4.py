"""The released Llama 4 text models' shapes for the planner (``tools/plan.py --model``), and the
total and active (per token) parameter counts of any MoE model.

Shapes from the Hub's ``config.json`` ``text_config`` of ``meta-llama/Llama-4-Scout-17B-16E``
and ``meta-llama/Llama-4-Maverick-17B-128E`` (Meta, April 2025): 48 layers, hidden 5120, 40
query heads in 8 groups of width 128, vocabulary 202048, untied output layer; experts of width
8192, top-1, one shared expert of width 8192; Scout has 16 experts on every layer, Maverick 128
experts on every other layer (``interleave_moe_layer_step`` 2) with dense layers of width 16384
between. The attention flags (chunks of 8192, NoPE every 4th layer, temperature tuning, q/k L2
norm on Scout) do not change the parameter count.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from megatron.config import ModelConfig
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.planner.memory import param_numels
from megatron.planner.moe import is_moe, stage_expert_numels, stage_moe_layers

VOCAB = 202048


def _shape(experts: int, step: int) -> Tuple[ModelConfig, MoEConfig]:
    layers = 48
    config = ModelConfig(num_layers=layers, hidden_size=5120, ffn_hidden_size=16384,
                         num_attention_heads=40, num_query_groups=8, kv_channels=128,
                         padded_vocab_size=VOCAB, max_position_embeddings=262144,
                         untie_embeddings_and_output_weights=True)
    moe = MoEConfig(num_experts=experts, moe_ffn_hidden_size=8192, moe_router_topk=1,
                    moe_layer_freq=tuple(int((i + 1) % step == 0) for i in range(layers)),
                    moe_router_score_function="sigmoid", moe_apply_probs_on_input=True,
                    moe_shared_expert_intermediate_size=8192)
    return config, moe


# name -> (model, MoE section); tools/plan.py --model NAME
SHAPES: Dict[str, Tuple[ModelConfig, MoEConfig]] = {
    "llama4-scout": _shape(16, 1),
    "llama4-maverick": _shape(128, 2),
}


def parameter_counts(config: ModelConfig, moe: Optional[MoEConfig]) -> Tuple[int, int]:
    """``(total, active)`` parameters of the whole model (one rank, no parallelism): active
    counts the ``moe_router_topk`` routed experts a token passes through, besides every dense
    parameter (embedding, output layer, attention, norms, routers, shared experts, dense MLPs)."""
    dense = sum(param_numels(config, 1, moe=moe))
    if not is_moe(moe):
        return dense, dense
    experts = sum(stage_expert_numels(config, moe, 1, 0, ep=1))
    per_expert = experts // (sum(stage_moe_layers(config, moe, 1, 0)) * moe.num_experts)
    routed = sum(stage_moe_layers(config, moe, 1, 0)) * moe.moe_router_topk * per_expert
    return dense + experts, dense + routed
