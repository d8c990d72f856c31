"""Model FLOPs of one training iteration (forward + backward), for TFLOP/s and MFU reporting."""

from __future__ import annotations

from typing import List, Optional

from megatron.config import ModelConfig
from megatron.core.transformer.moe.moe_config import MoEConfig


def moe_layers(moe: Optional[MoEConfig], num_layers: int) -> List[bool]:
    """Which of the ``num_layers`` layers are mixture-of-experts layers (``--moe-layer-freq``:
    an int N makes layers 0, N, 2N, ... MoE layers, as Megatron-Core reads it; a 0/1 per layer
    pattern is taken as it is); all False for a dense model (``num_experts`` None)."""
    if moe is None or not moe.num_experts:
        return [False] * num_layers
    freq = moe.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(num_layers)]
    if len(freq) != num_layers:
        raise ValueError(f"--moe-layer-freq has {len(freq)} entries for {num_layers} layers")
    return [bool(x) for x in freq]


def active_ffn_hidden_size(config: ModelConfig, moe: Optional[MoEConfig], layer: int) -> int:
    """The MLP width a token passes through in ``layer``: ``--ffn-hidden-size`` in a dense layer;
    in an MoE layer top-k experts of ``--moe-ffn-hidden-size`` (default ``--ffn-hidden-size``)
    plus the shared expert's ``--moe-shared-expert-intermediate-size``."""
    return active_ffn_hidden_sizes(config, moe)[layer]


def active_ffn_hidden_sizes(config: ModelConfig, moe: Optional[MoEConfig]) -> List[int]:
    """:func:`active_ffn_hidden_size` of every layer, in order (the layer pattern read once:
    the planner asks for every layer of thousands of layouts)."""
    if moe is None or not moe.num_experts:
        return [config.ffn_hidden_size] * config.num_layers
    expert = moe.moe_ffn_hidden_size or config.ffn_hidden_size
    width = moe.moe_router_topk * expert + (moe.moe_shared_expert_intermediate_size or 0)
    return [width if is_moe else config.ffn_hidden_size
            for is_moe in moe_layers(moe, config.num_layers)]


def num_floating_point_operations(config: ModelConfig, batch_size: int, seq_length: int,
                                  moe: Optional[MoEConfig] = None) -> float:
    """Floating-point operations of forward + backward over ``batch_size`` sequences.

    Megatron-LM's ``num_floating_point_operations`` (Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters", appendix), with its GQA and SwiGLU
    terms: 3 passes (forward, backward input and weight gradients) x 2 FLOPs per multiply-add,
    attention counted without causal savings, no activation recompute. A mixture-of-experts model
    counts the *active* FLOPs, as Megatron-LM does: an MoE layer's MLP term is the top-k routed
    experts' widths plus the shared expert's (:func:`active_ffn_hidden_size`); the router's
    ``[h, E]`` projection and the dispatch are not counted (Megatron-LM's convention).

    Args:
        config: the model configuration (whole model, all stages).
        batch_size: sequences per iteration (the global batch).
        seq_length: tokens per sequence.
        moe: the MoE section (None or ``num_experts`` None: dense).

    Returns:
        FLOPs (a float; units: floating-point operations).
    """
    h, layers = config.hidden_size, config.num_layers
    query_projection_ratio = config.kv_channels * config.num_attention_heads / h
    gated_linear_multiplier = 1.5  # SwiGLU: three ffn-sized matrices instead of two
    mlp = sum(active_ffn_hidden_sizes(config, moe)) / layers
    return 12.0 * batch_size * seq_length * layers * h * h * (
        (1 + config.num_query_groups / config.num_attention_heads + seq_length / h)
        * query_projection_ratio
        + mlp / h * gated_linear_multiplier
        + config.padded_vocab_size / (2 * layers * h))
