"""Frozen configuration built once from the parsed arguments and passed down explicitly.

Field names equal the argparse ``dest`` names of ``megatron/arguments.py``, so a grep leads from a
flag to the code that uses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a LLaMA model.

    Attributes:
        num_layers: transformer layers in the whole model (all pipeline stages).
        hidden_size: model width h.
        ffn_hidden_size: SwiGLU inner width (LLaMA-2 7B: 11008).
        num_attention_heads: query heads.
        num_query_groups: key/value heads (GQA); equals ``num_attention_heads`` for plain MHA.
        kv_channels: per-head width; ``hidden_size // num_attention_heads`` by default.
        padded_vocab_size: vocabulary rows of the embedding and output layer, already padded
            (``megatron.tokenizer.vocab_size_with_padding``).
        max_position_embeddings: longest sequence the rotary tables cover.
        norm_epsilon: RMSNorm epsilon.
        rotary_base: RoPE theta (10000; 500000 for Llama 3).
        rope_scaling: None, or a dict of Llama-3.1-style scaling ("factor", "low_freq_factor",
            "high_freq_factor", "original_max_position_embeddings").
        hidden_dropout / attention_dropout: dropout probabilities.
        init_method_std: std of the normal init; output projections use std / sqrt(2 * num_layers).
        untie_embeddings_and_output_weights: separate output layer (LLaMA) instead of tying it to
            the input embedding.
        add_bias_linear: biases on linear layers (False for LLaMA: ``--disable-bias-linear``).
        params_dtype: dtype of the model parameters (fp32, or bf16/fp16 for mixed precision).
        tensor_model_parallel_size: TP size the model is partitioned over.
        sequence_parallel: Megatron sequence parallelism (norms/dropout on ``[s/TP, b, h]``).
        seed: base seed of the layout-independent weight initialisation.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    padded_vocab_size: int
    max_position_embeddings: int
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    rope_scaling: Optional[dict] = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = False
    params_dtype: torch.dtype = torch.float32
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    seed: int = 1234

    def __post_init__(self):
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
