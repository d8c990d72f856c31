"""Llama 4's attention parts (iRoPE): chunked local attention on the RoPE layers, NoPE layers
with temperature-scaled queries, and the weightless q/k L2 norm (transformers'
``Llama4TextAttention``; Meta's ``llama_models/llama4/model.py``).

Chunked attention (``--attention-chunk-size C``): a query attends causally to the keys of its
own chunk of C tokens only. Chunks are counted from each document's first token (from the
sequence's first token when there is no document mask), so a packed document is attended
exactly as it would be alone; without packing this is transformers' ``create_chunked_causal_mask``
(``q // C == k // C``). The mask is never a dense ``[s, s]`` tensor:

* one sequence of documents-or-not at CP = 1 without documents: one causal SDPA per chunk over
  the whole micro-batch (:func:`chunked_attention`);
* packed documents, and context parallelism: the (document, chunk) segments become the
  document ids of an :class:`~megatron.model.attention_mask.AttentionMask`
  (:func:`chunk_document_ids`), which the per-document SDPA path and the context-parallel
  ``DocumentAttention`` already attend exactly (a chunk is a document that starts where the
  chunk does). CP therefore needs no code of its own: chunk boundaries inside and across the
  split are the document boundaries that path handles.

FlexAttention with a chunk ``BlockMask`` would do this in one kernel, but in torch 2.13 it has
no backward on the CPU (see :mod:`megatron.model.attention_mask`), so training on the CPU
layouts cannot use it; per-chunk SDPA keeps the fused causal kernel on every device.

Shapes: b = micro-batch, s = sequence, n = query heads, g = key/value groups, d = head width.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.model.attention_mask import AttentionMask, _sdpa, masked_attention


# The ModelConfig fields of Llama 4's attention, recorded in checkpoints' args under these names.
ATTENTION_FIELDS = ("rotary_interleaved", "qk_l2_norm", "no_rope_freq", "attention_chunk_size",
                    "attn_temperature_tuning", "attn_temperature_floor_scale",
                    "attn_temperature_scale")


def is_nope_layer(config, layer_number: int) -> bool:
    """Whether global 1-based ``layer_number`` is a NoPE layer (``config.no_rope_freq``)."""
    pattern = config.no_rope_freq
    return bool(pattern) and bool(pattern[layer_number - 1])


def no_rope_pattern(freq, num_layers: int) -> tuple:
    """``--no-rope-freq`` as one 0/1 per layer (1 = NoPE): every N-th layer counted from 1
    (Megatron-Core's ``(i + 1) % N == 0``; Llama 4's ``no_rope_layer_interval``), or the pattern.

    Raises:
        ValueError: N < 1, or a pattern of another length or with values other than 0/1.
    """
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"--no-rope-freq ({freq}) must be positive: N makes every N-th "
                             "layer a NoPE layer")
        return tuple(int((i + 1) % freq == 0) for i in range(num_layers))
    if len(freq) != num_layers or any(v not in (0, 1) for v in freq):
        raise ValueError(f"--no-rope-freq pattern {list(freq)} must hold one 0 or 1 per layer "
                         f"(--num-layers {num_layers})")
    return tuple(freq)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim in fp32, cast back (Llama 4's
    ``Llama4TextL2Norm``: an RMS norm without weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def attention_temperature(position_ids: torch.Tensor, floor_scale: float,
                          scale: float) -> torch.Tensor:
    """fp32 ``[s, b, 1, 1]`` query scale of the NoPE layers for ``position_ids [b, s]``:
    ``1 + scale * log(1 + floor((p + 1) / floor_scale))`` (Llama 4's attention temperature
    tuning). Positions are the tokens' own (``--reset-position-ids`` restarts them per document;
    transformers counts from the sequence start, which is the same without packing)."""
    p = position_ids.t().float()
    return (torch.log1p(torch.floor((p + 1.0) / floor_scale)) * scale + 1.0)[..., None, None]


def chunk_document_ids(document_ids: Optional[torch.Tensor], chunk_size: int, b: int,
                       s: int, device=None) -> torch.Tensor:
    """int64 ``[b, s]`` ids of the (document, chunk) segments of the whole sequence: a new
    segment starts at every document start and every ``chunk_size`` tokens into a document.

    Args:
        document_ids: ``[b, s]`` of the packed documents, or None (one document per row).
    """
    if document_ids is None:
        idx = torch.arange(s, device=device)
        return (idx // chunk_size).expand(b, s).contiguous()
    idx = torch.arange(s, device=document_ids.device).expand(b, s)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    segment_start = starts | ((idx - first) % chunk_size == 0)
    return torch.cumsum(segment_start.long(), dim=1) - 1


def chunked_mask(mask: Optional[AttentionMask], chunk_size: int, b: int, s_local: int,
                 cp_size: int = 1, cp_rank: int = 0, device=None) -> AttentionMask:
    """The chunked version of ``mask`` (None: causal) as a document mask over the whole
    sequence (``s_local * cp_size`` tokens), split as ``mask`` is.

    Raises:
        ValueError: a dense mask (its structure is unknown: give document ids).
    """
    if mask is not None and mask.kind == "dense":
        raise ValueError("chunked attention (--attention-chunk-size) takes causal or document "
                         "masks, not a dense [b, 1, s, s] mask")
    docs = None if mask is None else mask.document_ids
    ids = chunk_document_ids(docs, chunk_size, b, s_local * cp_size, device)
    return AttentionMask(document_ids=ids, cp_size=cp_size, cp_rank=cp_rank)


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Optional[AttentionMask], chunk_size: int,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """Chunked causal attention ``[b, n, s, d]`` of ``q [b, n, s, d]``, ``k, v [b, g, s, d]``
    at CP = 1: per-chunk causal SDPA over the whole micro-batch, or (packed documents) the
    per-segment path of :func:`~megatron.model.attention_mask.masked_attention`."""
    s = q.shape[2]
    if mask is None or mask.kind == "causal":
        if s <= chunk_size:
            return _sdpa(q, k, v, is_causal=True, dropout_p=dropout_p)
        parts = [_sdpa(q[:, :, a:a + chunk_size], k[:, :, a:a + chunk_size],
                       v[:, :, a:a + chunk_size], is_causal=True, dropout_p=dropout_p)
                 for a in range(0, s, chunk_size)]
        return torch.cat(parts, dim=2)
    return masked_attention(q, k, v, chunked_mask(mask, chunk_size, q.shape[0], s),
                            dropout_p)


def chunked_cache_mask(offset: int, s: int, chunk_size: Optional[int], device) -> torch.Tensor:
    """bool ``[1, 1, s, offset + s]`` (True = masked) of a generation step whose queries sit at
    positions ``offset .. offset + s - 1`` over the cached keys ``0 .. offset + s - 1``: causal,
    and within the query's chunk when ``chunk_size`` is given."""
    q_pos = torch.arange(offset, offset + s, device=device)[:, None]
    k_pos = torch.arange(offset + s, device=device)[None, :]
    masked = k_pos > q_pos
    if chunk_size is not None:
        masked = masked | (k_pos // chunk_size != q_pos // chunk_size)
    return masked[None, None]
