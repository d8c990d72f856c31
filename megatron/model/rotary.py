"""Rotary position embeddings (Su et al. 2021, "RoFormer", section 3.4), half-rotation convention.

The rotation pairs dimension ``i`` with ``i + d/2`` of each head (HuggingFace's ``rotate_half``,
which LLaMA checkpoints on the Hub are permuted for), not adjacent pairs as in the paper.
Llama-3.1 frequency scaling follows Meta's reference ``apply_scaling`` (``rope_scaling`` with
``rope_type: llama3``).

Shapes: s = sequence, b = micro-batch, n = heads, d = per-head width (kv_channels).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _llama3_scaled(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    """Llama-3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth
    interpolation between (Meta's ``apply_scaling``; transformers' ``_compute_llama3_parameters``)."""
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def check_rope_scaling(rope_scaling: Optional[dict]) -> None:
    """Refuse a ``rope_scaling`` we do not implement, instead of silently ignoring it.

    Raises:
        ValueError: if the type is not ``llama3`` or a required key is missing.
    """
    if rope_scaling is None:
        return
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported; only Llama-3.1-style "
                         f"'llama3' scaling is (got {rope_scaling!r})")
    missing = [k for k in _LLAMA3_KEYS if k not in rope_scaling]
    if missing:
        raise ValueError(f"rope_scaling {rope_scaling!r} lacks {missing}; llama3 scaling needs "
                         f"{list(_LLAMA3_KEYS)}")


class RotaryEmbedding(torch.nn.Module):
    """Computes the cos/sin tables of rotary embeddings from position ids.

    Angles, cos and sin are computed in fp32 whatever the model dtype (bf16 angles lose whole
    radians at long positions); they are cast to the activation dtype only when applied, as
    HuggingFace does. The inverse frequencies are a plain attribute, not a buffer, so
    ``model.to(torch.bfloat16)`` cannot round them.

    Args:
        kv_channels: per-head width d (even).
        rotary_base: theta (``--rotary-base``; 10000, 500000 for Llama 3).
        rope_scaling: None or a Llama-3.1 scaling dict (see :func:`check_rope_scaling`).

    Raises:
        ValueError: odd ``kv_channels`` or an unsupported ``rope_scaling``.
    """

    def __init__(self, kv_channels: int, rotary_base: float = 10000.0,
                 rope_scaling: Optional[dict] = None):
        super().__init__()
        if kv_channels % 2:
            raise ValueError(f"rotary embeddings need an even --kv-channels, got {kv_channels}")
        check_rope_scaling(rope_scaling)
        dim = kv_channels
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if rope_scaling is not None:
            inv_freq = _llama3_scaled(inv_freq, rope_scaling)
        self.inv_freq = inv_freq

    def forward(self, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)``, each ``[s, b, 1, d]`` fp32, for ``position_ids [b, s]`` (int)."""
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.t()[..., None].float() * inv_freq  # [s, b, d/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)
        return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """``[x1 c - sign x2 s, x2 c + sign x1 s]`` for the halves ``x1, x2`` of the last dim, written
    into one new contiguous tensor (no ``rotate_half`` copy, no concatenation)."""
    half = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x1, x2, o1, o2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin, value=sign)
    return out


class _RotaryFunction(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin``: four element-wise passes forward and backward (the
    composite takes eight, plus a concatenation) and nothing kept but views of the fp32 tables.
    The rotation is orthogonal, so the input gradient is the gradient rotated back (``-sin``)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        half = x.shape[-1] // 2
        # The tables repeat their first half (cat((freqs, freqs))): one half is the whole table.
        cos, sin = cos[..., :half], sin[..., :half]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos.to(x.dtype), sin.to(x.dtype), 1.0)

    @staticmethod
    def backward(ctx, grad_output):
        cos, sin = ctx.saved_tensors
        dtype = grad_output.dtype
        return _rotate(grad_output, cos.to(dtype), sin.to(dtype), -1.0), None, None


def _apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Adjacent pairs ``(x[2i], x[2i+1])`` as the complex number ``x[2i] + i x[2i+1]`` times
    ``exp(i theta_i)`` (Meta's reference ``apply_rotary_emb``; transformers' Llama 4), computed
    in fp32 and cast back to ``x``'s dtype as both do."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    pairs = x.float().unflatten(-1, (half, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x [s, b, n, d]`` by the angles of ``cos``/``sin [s, b, 1, d]`` (fp32, as
    :class:`RotaryEmbedding` returns them: both halves of the last dim equal).

    Returns a new contiguous ``[s, b, n, d]`` in ``x``'s dtype; the tables are cast to that dtype
    first, as HuggingFace's ``apply_rotary_pos_emb`` does. Under ``torch.compile`` the plain
    expression is traced instead (the compiler fuses it by itself). ``interleaved``
    (``--rotary-interleaved``): pairs ``(2i, 2i + 1)`` instead of ``(i, i + d/2)``, in fp32.
    """
    if interleaved:
        return _apply_interleaved(x, cos, sin)
    if torch.compiler.is_compiling():
        half = x.shape[-1] // 2
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    return _RotaryFunction.apply(x, cos, sin)
