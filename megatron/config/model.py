"""The model section of the configuration: shape and numerics of a LLaMA model.

Each field's docstring names its flag (or says how it is derived), its unit and the flag's
default; the dataclass defaults serve models built in code (tests, tools, benchmarks) and may
differ (no dropout, for one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a LLaMA model (Touvron et al. 2023), what ``LlamaModel`` reads."""

    num_layers: int
    """``--num-layers``: transformer layers of the whole model (all pipeline stages). Required."""
    hidden_size: int
    """``--hidden-size``: model width h. Required."""
    ffn_hidden_size: int
    """``--ffn-hidden-size``: SwiGLU inner width (LLaMA-2 7B: 11008); flag default
    ``int(4h * 2/3 / 64) * 64`` (Megatron's rule, filled by validation)."""
    num_attention_heads: int
    """``--num-attention-heads``: query heads. Required."""
    padded_vocab_size: int
    """Derived: vocabulary rows of the embedding and output layer, the tokenizer's vocabulary
    padded to a multiple of ``--make-vocab-size-divisible-by`` x TP
    (``megatron.tokenizer.vocab_size_with_padding``)."""
    max_position_embeddings: int
    """``--max-position-embeddings``: longest sequence (tokens) the rotary tables cover; flag
    default ``--seq-length``."""
    true_vocab_size: Optional[int] = None
    """Derived: the tokenizer's vocabulary size (ids ``0 .. true_vocab_size - 1`` are real). Rows
    from it up to ``padded_vocab_size`` are padding: they start at zero, their logits never enter
    the loss (training and evaluation, fused and unfused) nor a sample, so they get no gradient
    and any padding gives the same loss. Recorded in checkpoints' args (HF export, inference; a
    torch_dist load at another padding checks it). None: every row is real (models built in
    code)."""
    num_query_groups: Optional[int] = None
    """``--num-query-groups`` (with ``--group-query-attention``): key/value heads (GQA); equals
    ``num_attention_heads`` for plain multi-head attention (the default)."""
    kv_channels: Optional[int] = None
    """``--kv-channels``: per-head width; default ``hidden_size // num_attention_heads``."""
    norm_epsilon: float = 1e-5
    """``--norm-epsilon`` / ``--layernorm-epsilon``: RMSNorm epsilon. Default 1e-5."""
    rotary_base: float = 10000.0
    """``--rotary-base``: RoPE theta (10000; 500000 for Llama 3). Default 10000."""
    rope_scaling: Optional[dict] = None
    """Derived from ``--use-rope-scaling`` and ``--rope-scaling-*``: None, or HuggingFace's
    Llama-3.1 dict (``rope_type`` llama3, ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``)."""
    hidden_dropout: float = 0.0
    """``--hidden-dropout``: dropout probability of the hidden states. Flag default 0.1."""
    attention_dropout: float = 0.0
    """``--attention-dropout``: dropout probability of the attention weights. Flag default 0.1."""
    init_method_std: float = 0.02
    """``--init-method-std``: std of the normal init; output projections use
    ``std / sqrt(2 * num_layers)``. Default 0.02."""
    untie_embeddings_and_output_weights: bool = True
    """``--untie-embeddings-and-output-weights`` (implied by ``--causal-lm``): a separate output
    layer (LLaMA) instead of the input embedding's weight. Flag default off (tied)."""
    add_bias_linear: bool = False
    """``--disable-bias-linear`` turns it off: biases on linear layers (False for LLaMA). Flag
    default on."""
    add_qkv_bias: bool = False
    """``--add-qkv-bias``: a bias on the fused query/key/value projection only (Qwen2's and
    Qwen2-MoE's q/k/v biases), whatever ``add_bias_linear``. Default off."""
    qk_layernorm: bool = False
    """``--qk-layernorm``: RMSNorm of each query and key head over its ``kv_channels`` before
    RoPE (Qwen3 / Qwen3-MoE's ``q_norm`` / ``k_norm``; Megatron-Core's ``q_layernorm`` /
    ``k_layernorm``). Default off."""
    rotary_interleaved: bool = False
    """``--rotary-interleaved``: RoPE rotates adjacent pairs ``(2i, 2i + 1)`` of each head (the
    complex-pair convention of Meta's reference code and of Llama 4 in transformers) instead of
    the halves ``(i, i + d/2)``. Default off."""
    qk_l2_norm: bool = False
    """``--qk-l2-norm``: a weightless RMS (L2) norm of each query and key head after RoPE, on the
    RoPE layers only (Llama 4's ``use_qk_norm``, eps ``--norm-epsilon``). Default off."""
    no_rope_freq: Optional[tuple] = None
    """``--no-rope-freq``: one 0/1 per layer, 1 = a NoPE layer (no rotary embedding, full causal
    attention; Llama 4's ``no_rope_layers`` inverted); validation expands an integer N to every
    N-th layer (``(i + 1) % N == 0``, Megatron-Core's rule). Default None (RoPE everywhere)."""
    attention_chunk_size: Optional[int] = None
    """``--attention-chunk-size``: tokens per chunk of the RoPE layers' chunked local attention
    (a query sees the causal keys of its own chunk; Llama 4: 8192). Default None (full causal)."""
    attn_temperature_tuning: bool = False
    """``--attn-temperature-tuning``: the NoPE layers scale queries at position p by
    ``1 + attn_temperature_scale * log(1 + floor((p + 1) / attn_temperature_floor_scale))``
    (Llama 4; Nakanishi 2025, arXiv 2501.19399). Default off."""
    attn_temperature_floor_scale: float = 8192.0
    """``--attn-temperature-floor-scale``: Llama 4's ``floor_scale`` (tokens). Default 8192."""
    attn_temperature_scale: float = 0.1
    """``--attn-temperature-scale``: Llama 4's ``attn_scale``. Default 0.1."""
    qk_layernorm_full_width: bool = False
    """``--qk-layernorm-full-width`` (with ``--qk-layernorm``): the q and k RMSNorms over the whole
    projection, ``[nh d]`` and ``[ng d]``, not per head (OLMoE's ``q_norm`` / ``k_norm``; no
    Megatron-Core flag). TP 1 only. Default off."""
    params_dtype: torch.dtype = torch.float32
    """Derived from ``--bf16`` / ``--fp16``: dtype of the model parameters (fp32 otherwise)."""
    tensor_model_parallel_size: int = 1
    """``--tensor-model-parallel-size``: TP the model is partitioned over (the parallel section
    holds the same flag). Default 1."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: norms and dropout on ``[s/TP, b, h]`` (off at TP = 1; the parallel
    section holds the same flag). Default off."""
    context_parallel_size: int = 1
    """``--context-parallel-size``: CP ranks each sequence is split over; attention then runs
    :func:`megatron.core.context_parallel.context_parallel_attention` (the parallel section holds
    the same flag). Default 1."""
    cp_comm_type: str = "p2p"
    """``--cp-comm-type``: ``p2p`` (ring exchange of K/V blocks) or ``all_gather`` (Llama 3's
    all-gather of K/V); Megatron-LM's ``allgather`` is normalized by validation. Default p2p."""
    recompute_granularity: Optional[str] = None
    """``--recompute-granularity`` (``--recompute-activations`` = selective): None, ``selective``
    (the parts named by ``recompute_modules`` inside each layer) or ``full`` (whole layers);
    see :mod:`megatron.model.recompute`. Default None."""
    recompute_method: Optional[str] = None
    """``--recompute-method``: with full granularity, ``uniform`` (groups of
    ``recompute_num_layers`` layers) or ``block`` (the first ``recompute_num_layers`` layers of
    each stage / model chunk). Default None."""
    recompute_num_layers: Optional[int] = None
    """``--recompute-num-layers``: layers per group (uniform) or recomputed layers per stage
    (block). Default None."""
    recompute_modules: Optional[tuple] = None
    """``--recompute-modules``: what selective recompute recomputes (``core_attn``, ``act``,
    ``layernorm``, ``mlp``); default None, meaning ``core_attn act layernorm``."""
    seed: int = 1234
    """``--seed``: base seed of the layout-independent weight initialisation (the training
    section holds the same flag). Default 1234."""
    gradient_accumulation_fusion: bool = True
    """``--no-gradient-accumulation-fusion`` turns it off: weight gradients accumulate straight
    into the DDP ``main_grad`` buffers (:mod:`megatron.core.tensor_parallel.grad_accumulation`).
    Default on."""

    def __post_init__(self):
        if self.true_vocab_size is not None and not 0 < self.true_vocab_size <= self.padded_vocab_size:
            raise ValueError(f"the vocabulary ({self.true_vocab_size} ids) must be positive and fit "
                             f"the padded vocabulary ({self.padded_vocab_size} rows)")
        if self.recompute_modules is not None:
            object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def vocab_size(self) -> int:
        """The real vocabulary rows: ``true_vocab_size``, or every row when it is None."""
        return self.padded_vocab_size if self.true_vocab_size is None else self.true_vocab_size
