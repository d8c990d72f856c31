"""Causal self-attention with grouped-query attention, rotary embeddings and a fused QKV weight.

Shapes: s = sequence, b = micro-batch, h = hidden, n = query heads of this tensor-parallel rank,
g = key/value groups of this rank, d = per-head width (kv_channels).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.config import ModelConfig
from megatron.core.context_parallel import context_parallel_attention
from megatron.core.tensor_parallel.checkpoint_without_output import CheckpointWithoutOutput
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.model.attention_mask import AttentionMask, masked_attention
from megatron.model.chunked_attention import (chunked_attention, chunked_cache_mask, chunked_mask,
                                              is_nope_layer, l2_norm)
from megatron.core.transformer.initialization import (fused_init_method, normal_block_init,
                                                      scaled_std)
from megatron.model.full_width_qk_norm import FullWidthRMSNorm
from megatron.model.recompute import recompute_active, selective_modules
from megatron.model.rms_norm import RMSNorm
from megatron.model.rotary import apply_rotary_pos_emb


def check_attention_config(config: ModelConfig) -> None:
    """Raises ValueError naming the flag when heads or groups do not split over TP."""
    tp = config.tensor_model_parallel_size
    nh, ng = config.num_attention_heads, config.num_query_groups
    if nh % tp:
        raise ValueError(f"--num-attention-heads ({nh}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if ng % tp:
        raise ValueError(f"--num-query-groups ({ng}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp}); use a smaller TP or more groups")
    if nh % ng:
        raise ValueError(f"--num-attention-heads ({nh}) must be divisible by --num-query-groups ({ng})")
    if getattr(config, "qk_layernorm_full_width", False) and not config.qk_layernorm:
        raise ValueError("--qk-layernorm-full-width needs --qk-layernorm (it says how wide the "
                         "q/k norms are): add --qk-layernorm")


def _check_context_parallel_inputs(attention_mask, inference_params, dropout_p: float) -> None:
    """Refuse what the split attention does not do (validation refuses the flags first)."""
    if attention_mask is not None and attention_mask.kind == "dense":
        raise ValueError("context-parallel attention takes causal or document masks, not a "
                         "dense [b, 1, s, s] mask")
    if inference_params is not None:
        raise ValueError("generation with a KV cache does not run under --context-parallel-size "
                         "> 1; load the model with context-parallel size 1")
    if dropout_p > 0.0:
        raise ValueError(f"--attention-dropout ({dropout_p}) must be 0 with "
                         "--context-parallel-size > 1")


def check_attention_mask(attention_mask) -> None:
    """Raises TypeError for anything but None or an :class:`AttentionMask` (a dense tensor is
    wrapped with ``AttentionMask.from_dense`` by whoever builds it)."""
    if attention_mask is not None and not isinstance(attention_mask, AttentionMask):
        raise TypeError(f"attention_mask must be None or a megatron.model.attention_mask."
                        f"AttentionMask, got {type(attention_mask).__name__}; wrap a dense bool "
                        f"[b, 1, s, s] mask with AttentionMask.from_dense")


class SelfAttention(torch.nn.Module):
    """LLaMA attention block, tensor-parallel over heads (Megatron-LM's ``ParallelAttention``).

    ``query_key_value`` is a ColumnParallelLinear ``h -> (nh + 2 ng) d`` whose rows on each rank
    are ``[Q heads of the rank; K groups of the rank; V groups of the rank]``
    (:mod:`megatron.core.transformer.initialization`); ``dense`` is a RowParallelLinear ``nh d -> h`` with
    the scaled init. Query head ``i`` reads key/value group ``i // (nh / ng)`` (as HuggingFace's
    ``repeat_kv``), which keeps every rank's heads with their own groups.

    Selective recompute of ``core_attn`` (:mod:`megatron.model.recompute`): RoPE and SDPA keep
    nothing but ``qkv``; their output is recomputed when backward reaches ``dense``.

    Args:
        config: the model configuration.
        layer_number: global 1-based layer number (seeds the initialisation).
        pg_collection: the process groups (the linears use ``pg_collection.tp``).
        device: device of the parameters.
    """

    def __init__(self, config: ModelConfig, layer_number: int, *, pg_collection, device=None):
        super().__init__()
        check_attention_config(config)
        tp = config.tensor_model_parallel_size
        d = config.kv_channels
        self.heads_per_partition = config.num_attention_heads // tp
        self.groups_per_partition = config.num_query_groups // tp
        self.kv_channels = d
        self.layer_number = layer_number
        self.attention_dropout = config.attention_dropout
        common = dict(bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype, device=device, tp_group=pg_collection.tp.group,
                      gradient_accumulation_fusion=config.gradient_accumulation_fusion)
        rows = [config.num_attention_heads * d, config.num_query_groups * d,
                config.num_query_groups * d]
        std, seed = config.init_method_std, config.seed
        blocks = [(r, normal_block_init(std, seed, layer_number, f"self_attention.{name}"))
                  for r, name in zip(rows, ("query", "key", "value"))]
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size, sum(rows), gather_output=False,
            init_method=fused_init_method(blocks, tp),
            **dict(common, bias=config.add_bias_linear or config.add_qkv_bias))
        self.dense = RowParallelLinear(
            config.num_attention_heads * d, config.hidden_size, input_is_parallel=True,
            init_method=normal_block_init(scaled_std(std, config.num_layers), seed, layer_number,
                                          "self_attention.dense"),
            **common)
        self.q_layernorm = self.k_layernorm = None
        self.qk_layernorm_full_width = config.qk_layernorm_full_width
        if config.qk_layernorm:
            norm = dict(eps=config.norm_epsilon, params_dtype=config.params_dtype, device=device)
            if self.qk_layernorm_full_width:  # OLMoE: over the whole width, sharded with heads
                self.q_layernorm, self.k_layernorm = (
                    FullWidthRMSNorm(w, pg_collection.tp.group, **norm)
                    for w in (config.num_attention_heads * d, config.num_query_groups * d))
            else:
                self.q_layernorm, self.k_layernorm = RMSNorm(d, **norm), RMSNorm(d, **norm)
            if tp > 1 and not self.qk_layernorm_full_width:  # per head: the same weights on
                for p in (self.q_layernorm.weight, self.k_layernorm.weight):  # every rank, each
                    p.sequence_parallel = True  # rank's heads give part of the gradient, summed
        self.recompute_core_attn = "core_attn" in selective_modules(config)
        # Llama 4 (megatron.model.chunked_attention): NoPE layers attend to the whole causal
        # context with temperature-scaled queries; RoPE layers may be chunked and L2-normed.
        self.use_rope = not is_nope_layer(config, layer_number)
        self.rotary_interleaved = config.rotary_interleaved
        self.qk_l2_norm_eps = config.norm_epsilon if config.qk_l2_norm and self.use_rope else None
        self.chunk_size = config.attention_chunk_size if self.use_rope else None
        self.scale_queries = config.attn_temperature_tuning and not self.use_rope
        # Context parallelism: this rank holds 2 of the 2 CP chunks of each sequence
        # (megatron.core.context_parallel); attention communicates over the CP group.
        self.cp_group = pg_collection.cp.group if pg_collection.cp.size > 1 else None
        self.cp_comm_type = config.cp_comm_type
        self.cp_size, self.cp_rank = pg_collection.cp.size, pg_collection.cp.rank

    def fused_row_blocks(self):
        """The logical blocks of this rank's fused rows, for checkpoints in global coordinates
        (:mod:`megatron.model.sharded_state`): ``{parameter: [(block, local rows)]}``."""
        d = self.kv_channels
        rows = [("query", self.heads_per_partition * d), ("key", self.groups_per_partition * d),
                ("value", self.groups_per_partition * d)]
        return {"query_key_value.weight": rows, "query_key_value.bias": rows}

    def forward(self, hidden: torch.Tensor, rotary: Tuple[torch.Tensor, torch.Tensor],
                attention_mask: Optional[AttentionMask] = None,
                inference_params=None) -> torch.Tensor:
        """Attend.

        Args:
            hidden: ``[s, b, h]``, or this rank's chunk ``[s/T, b, h]`` with sequence parallelism
                (gathered by ``query_key_value``; the output is reduce-scattered back).
            rotary: ``(cos, sin)``, each ``[s, b, 1, d]`` fp32 (:class:`RotaryEmbedding`).
            attention_mask: None (causal) or an
                :class:`~megatron.model.attention_mask.AttentionMask`: causal, document ids of
                packed sequences (``--reset-attention-mask``), or a dense mask.
            inference_params: None (training), or a
                :class:`megatron.inference.InferenceParams` KV cache: this step's keys/values are
                appended to the layer's cache and the queries attend to all cached positions.

        Returns:
            ``[s, b, h]`` (the row-parallel output, all-reduced over the tensor-parallel group), or
            ``[s/T, b, h]`` reduce-scattered with sequence parallelism.
        """
        check_attention_mask(attention_mask)
        qkv, _ = self.query_key_value(hidden)
        query_scale = rotary[2] if self.scale_queries else None
        if not (self.recompute_core_attn and inference_params is None and recompute_active(self)):
            out, _ = self.dense(self._core_attention(qkv, rotary[0], rotary[1], attention_mask,
                                                     inference_params, query_scale))
            return out
        ckpt = CheckpointWithoutOutput()
        out, _ = self.dense(ckpt.checkpoint(self._core_attention, qkv, rotary[0], rotary[1],
                                            attention_mask, None, query_scale))
        ckpt.discard_output_and_register_recompute(out)
        return out

    def _core_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        attention_mask: Optional[AttentionMask],
                        inference_params=None, query_scale=None) -> torch.Tensor:
        """RoPE and SDPA: ``qkv [s, b, (n + 2 g) d] -> [s, b, n d]``; ``query_scale``
        ``[s, b, 1, 1]``: the NoPE layers' attention temperature, or None."""
        s, b = qkv.shape[:2]
        n, g, d = self.heads_per_partition, self.groups_per_partition, self.kv_channels
        q, k, v = qkv.split([n * d, g * d, g * d], dim=-1)
        if self.qk_layernorm_full_width:  # over the whole projection, before RoPE (OLMoE)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = q.reshape(s, b, n, d), k.reshape(s, b, g, d)
        if self.q_layernorm is not None and not self.qk_layernorm_full_width:
            q, k = self.q_layernorm(q), self.k_layernorm(k)  # per head (Qwen3's q_norm / k_norm)
        if self.use_rope:
            q = apply_rotary_pos_emb(q, cos, sin, self.rotary_interleaved)
            k = apply_rotary_pos_emb(k, cos, sin, self.rotary_interleaved)
        if self.qk_l2_norm_eps is not None:  # after RoPE, as transformers' Llama 4
            q, k = l2_norm(q, self.qk_l2_norm_eps), l2_norm(k, self.qk_l2_norm_eps)
        if query_scale is not None:
            q = (q * query_scale).to(q.dtype)
        # A copy: kept by SDPA for backward, a view would keep the whole QKV output alive.
        v = v.contiguous().view(s, b, g, d)
        if inference_params is not None and hasattr(inference_params, "attend"):
            # A paged KV cache (megatron.inference.engine) attends per request over its blocks
            # (on the RoPE layers of Llama 4 over its chunk's blocks only).
            return inference_params.attend(self.layer_number, q, k, v,
                                           chunk_size=self.chunk_size).reshape(s, b, n * d)
        if inference_params is not None:
            k, v = inference_params.append_kv(self.layer_number, k, v)
            cache_mask = inference_params.attention_mask(s, q.device)
            if self.chunk_size is not None and cache_mask is not None:
                cache_mask = chunked_cache_mask(inference_params.sequence_len_offset, s,
                                                self.chunk_size, q.device)
            attention_mask = None if cache_mask is None else AttentionMask.from_dense(cache_mask)
        # SDPA wants [b, heads, s, d]; it shares each key/value head among n/g query heads itself
        # (enable_gqa), so no repeated copies of k and v are made or kept for backward.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.cp_group is not None:
            _check_context_parallel_inputs(attention_mask, inference_params, dropout_p)
            if self.chunk_size is not None:  # chunks are documents of the whole sequence
                attention_mask = chunked_mask(attention_mask, self.chunk_size, b, s,
                                              self.cp_size, self.cp_rank, q.device)
            documents = None if attention_mask is None else attention_mask.document_ids
            out = context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type,
                                             document_ids=documents)
            return out.permute(2, 0, 1, 3).reshape(s, b, n * d)
        attend = masked_attention
        # A generation step after the first has its chunked dense mask (above); training and
        # the prompt attend in chunks (a dense training mask is refused by chunked_mask).
        if self.chunk_size is not None and (inference_params is None or attention_mask is None):
            def attend(q, k, v, mask, p=0.0):
                return chunked_attention(q, k, v, mask, self.chunk_size, p)
        if dropout_p > 0.0:
            # Heads differ per tensor-parallel rank, so their dropout masks must too.
            with get_rng_tracker().fork():
                out = attend(q, k, v, attention_mask, dropout_p)
        else:
            out = attend(q, k, v, attention_mask)
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)
