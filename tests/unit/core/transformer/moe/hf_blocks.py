"""transformers' MoE blocks of each family and our layer on the same weights (test helpers)."""

from __future__ import annotations

import torch

from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe import MoELayer

H, F_EXPERT = 16, 12


def _init(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in list(module.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def mixtral(norm=None):
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = MixtralConfig(hidden_size=H, intermediate_size=F_EXPERT, num_local_experts=8,
                        num_experts_per_tok=2, router_jitter_noise=0.0)
    return _init(MixtralSparseMoeBlock(cfg), 1), MoEConfig(num_experts=8, moe_router_topk=2)


def qwen2_moe(norm_topk_prob):
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=F_EXPERT, num_experts=8,
                         num_experts_per_tok=4, norm_topk_prob=norm_topk_prob,
                         shared_expert_intermediate_size=20)
    ours = MoEConfig(num_experts=8, moe_router_topk=4, moe_router_pre_softmax=not norm_topk_prob,
                     moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True)
    return _init(Qwen2MoeSparseMoeBlock(cfg), 2), ours


def qwen3_moe(norm_topk_prob):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F_EXPERT, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    ours = MoEConfig(num_experts=8, moe_router_topk=2, moe_router_pre_softmax=not norm_topk_prob)
    return _init(Qwen3MoeSparseMoeBlock(cfg), 3), ours


def olmoe(norm=None):
    from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    cfg = OlmoeConfig(hidden_size=H, intermediate_size=F_EXPERT, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=False)
    ours = MoEConfig(num_experts=8, moe_router_topk=2, moe_router_pre_softmax=True)
    return _init(OlmoeSparseMoeBlock(cfg), 4), ours


def deepseek_v3(norm=None):
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=F_EXPERT, n_routed_experts=16,
                           num_experts_per_tok=4, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1)
    block = _init(DeepseekV3MoE(cfg), 5)
    g = torch.Generator().manual_seed(55)
    block.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.2)
    ours = MoEConfig(num_experts=16, moe_router_topk=4, moe_router_score_function="sigmoid",
                     moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                     moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                     moe_router_dtype="fp32", moe_shared_expert_intermediate_size=F_EXPERT)
    return block, ours


def llama4(norm=None):
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
    cfg = Llama4TextConfig(hidden_size=H, intermediate_size=F_EXPERT, num_local_experts=8,
                           num_experts_per_tok=1)
    ours = MoEConfig(num_experts=8, moe_router_topk=1, moe_router_score_function="sigmoid",
                     moe_apply_probs_on_input=True, moe_shared_expert_intermediate_size=F_EXPERT)
    return _init(Llama4TextMoe(cfg), 6), ours


FAMILIES = {"mixtral": (mixtral, None), "qwen2_moe_norm": (qwen2_moe, True),
            "qwen2_moe_no_norm": (qwen2_moe, False), "qwen3_moe_norm": (qwen3_moe, True),
            "qwen3_moe_no_norm": (qwen3_moe, False), "olmoe": (olmoe, None),
            "deepseek_v3": (deepseek_v3, None), "llama4": (llama4, None)}


def hf_router(block):
    return block.router if hasattr(block, "router") else block.gate


def hf_route(block, x):
    """``(indices [T, k], probs [T, k])`` of transformers' router on ``x [T, h]``."""
    router = hf_router(block)
    out = router(x)
    if hasattr(block, "router"):  # Llama 4: scores [T, E] with zeros off the top-k
        scores, _ = out
        k = router.top_k
        probs, indices = scores.topk(k, dim=-1)
        return indices, probs
    _, probs, indices = out
    return indices, probs


def our_layer(block, config: MoEConfig, grouped_gemm=False):
    """Our layer holding ``block``'s weights."""
    import dataclasses
    config = dataclasses.replace(config, moe_grouped_gemm=grouped_gemm)
    layer = MoELayer(config, hidden_size=H, ffn_hidden_size=F_EXPERT, seed=0, layer_number=1)
    with torch.no_grad():
        layer.router.weight.copy_(hf_router(block).weight)
        experts = block.experts
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if hasattr(block, "router"):  # Llama 4 stores [E, h, 2f] / [E, f, h]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        layer.experts.weight1.copy_(gate_up)
        layer.experts.weight2.copy_(down)
        shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
        if shared is not None:
            layer.shared_experts.linear_fc1.copy_(torch.cat([shared.gate_proj.weight,
                                                             shared.up_proj.weight]))
            layer.shared_experts.linear_fc2.copy_(shared.down_proj.weight)
        if getattr(block, "shared_expert_gate", None) is not None:
            layer.shared_experts.gate_weight.copy_(block.shared_expert_gate.weight)
        if config.moe_router_enable_expert_bias:
            layer.router.expert_bias.copy_(block.gate.e_score_correction_bias)
    return layer
