"""Model FLOPs of one training iteration (forward + backward), for TFLOP/s and MFU reporting."""

from __future__ import annotations

from megatron.config import ModelConfig


def num_floating_point_operations(config: ModelConfig, batch_size: int, seq_length: int) -> float:
    """Floating-point operations of forward + backward over ``batch_size`` sequences.

    Megatron-LM's ``num_floating_point_operations`` (Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters", appendix), with its GQA and SwiGLU
    terms: 3 passes (forward, backward input and weight gradients) x 2 FLOPs per multiply-add,
    attention counted without causal savings, no activation recompute.

    Args:
        config: the model configuration (whole model, all stages).
        batch_size: sequences per iteration (the global batch).
        seq_length: tokens per sequence.

    Returns:
        FLOPs (a float; units: floating-point operations).
    """
    h, layers = config.hidden_size, config.num_layers
    query_projection_ratio = config.kv_channels * config.num_attention_heads / h
    gated_linear_multiplier = 1.5  # SwiGLU: three ffn-sized matrices instead of two
    return 12.0 * batch_size * seq_length * layers * h * h * (
        (1 + config.num_query_groups / config.num_attention_heads + seq_length / h)
        * query_projection_ratio
        + config.ffn_hidden_size / h * gated_linear_multiplier
        + config.padded_vocab_size / (2 * layers * h))
