"""Softmax attention of one block of queries against one block of keys, with its log-sum-exp.

The context-parallel attentions (:mod:`megatron.core.context_parallel.attention`) split one
attention into blocks and merge the results by their log-sum-exp (the online softmax of Milakov &
Gimelshein 2018, as FlashAttention, Dao et al. 2022, section 3.1, does inside a kernel). Each
block needs its forward to return ``lse`` and its backward to accept the *merged* output and
``lse`` of the whole row: with ``P = exp(S - lse)`` and ``D = rowsum(dO * O)`` of the merged
result, the block's ``dQ``, ``dK``, ``dV`` are exactly its share of the full gradient (FlashAttention
backward, Dao et al. 2022, appendix B.2).

Two implementations behind one pair of functions:

* CPU: ATen's fused flash kernel ``_scaled_dot_product_flash_attention_for_cpu`` and its backward
  (the kernel ``torch.nn.functional.scaled_dot_product_attention`` itself runs on CPU, so a split
  attention and the unsplit one do the same arithmetic per block; grouped-query attention is
  native, key/value heads are not repeated).
* Anything else (CUDA included): plain tensor operations, tiled over query rows so at most
  ``_TILE_ELEMENTS`` scores are held at once, in fp32 (fp64 for fp64 inputs). It is exact but
  not a fused kernel: the scores of a tile are materialized.

Shapes: b = micro-batch, n = query heads, g = key/value groups (n divisible by g; query head
``j`` reads group ``j // (n / g)``), sq / sk = query / key block lengths, d = head width.
"""

from __future__ import annotations

from typing import Tuple

import torch

# Scores held at once by the tiled implementation (fp32: 256 MiB).
_TILE_ELEMENTS = 1 << 26

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                              None)


def _use_cpu_kernel(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _CPU_FLASH is not None and _CPU_FLASH_BACKWARD is not None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value groups "
                         f"({k.shape[1]})")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"a causal block must be square, got {q.shape[2]} queries and "
                         f"{k.shape[2]} keys")


def attention_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                            scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scale q k^T [+ causal mask]) v`` and the log-sum-exp of each query row.

    Args:
        q: ``[b, n, sq, d]``; k, v: ``[b, g, sk, d]`` (any strides), one dtype.
        causal: mask key ``j > `` query ``i`` (needs ``sq == sk``: the block is a diagonal one).
        scale: the softmax scale (``1 / sqrt(d)``).

    Returns:
        ``(out [b, n, sq, d] in q's dtype, lse [b, n, sq])``; ``lse`` is fp32 (fp64 for fp64
        inputs), the natural log of the row's sum of ``exp(scale q k^T)``.

    Raises:
        ValueError: n not a multiple of g, or a causal block that is not square.
    """
    _check(q, k, causal)
    if _use_cpu_kernel(q):
        out, lse = _CPU_FLASH(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(_compute_dtype(q.dtype))
    return _tiled_forward(q, k, v, causal, scale)


def attention_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                             scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's share of the attention gradient.

    Args:
        dout: ``[b, n, sq, d]`` gradient of the *merged* output of these query rows.
        q, k, v, causal, scale: as :func:`attention_block_forward`.
        out: ``[b, n, sq, d]`` the merged output of these rows (over every key block).
        lse: ``[b, n, sq]`` the merged log-sum-exp of these rows.

    Returns:
        ``(dq [b, n, sq, d], dk [b, g, sk, d], dv [b, g, sk, d])`` in the inputs' dtype on CPU,
        in fp32 (fp64) otherwise; the caller sums them over blocks.
    """
    _check(q, k, causal)
    if _use_cpu_kernel(q):
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()
        return _CPU_FLASH_BACKWARD(dout.contiguous(), q, k, v, out.contiguous(), lse, 0.0, causal,
                                   scale=scale)
    return _tiled_backward(dout, q, k, v, out, lse, causal, scale)


def _tiles(b: int, n: int, sq: int, sk: int):
    rows = max(1, _TILE_ELEMENTS // max(1, b * n * sk))
    for start in range(0, sq, rows):
        yield start, min(sq, start + rows)


def _scores(qt: torch.Tensor, k: torch.Tensor, start: int, causal: bool, scale: float):
    """Scores ``[b, g, r, t, sk]`` of query rows ``start..start+t`` (``qt [b, g, r, t, d]``)."""
    s = torch.matmul(qt, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        t, sk = qt.shape[3], k.shape[2]
        rows = torch.arange(start, start + t, device=qt.device).unsqueeze(1)
        s = s.masked_fill(torch.arange(sk, device=qt.device).unsqueeze(0) > rows, float("-inf"))
    return s


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    b, n, s, d = x.shape
    return x.reshape(b, g, n // g, s, d)


def _tiled_forward(q, k, v, causal, scale):
    b, n, sq, d = q.shape
    g, sk = k.shape[1], k.shape[2]
    ct = _compute_dtype(q.dtype)
    qg, kf, vf = _grouped(q, g).to(ct), k.to(ct), v.to(ct)
    out = torch.empty(b, g, n // g, sq, d, dtype=ct, device=q.device)
    lse = torch.empty(b, g, n // g, sq, dtype=ct, device=q.device)
    for start, end in _tiles(b, n, sq, sk):
        s = _scores(qg[:, :, :, start:end], kf, start, causal, scale)
        lse[..., start:end] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., start:end, None])
        out[..., start:end, :] = torch.matmul(p, vf.unsqueeze(2))
    return out.reshape(b, n, sq, d).to(q.dtype), lse.reshape(b, n, sq)


def _tiled_backward(dout, q, k, v, out, lse, causal, scale):
    b, n, sq, d = q.shape
    g, sk = k.shape[1], k.shape[2]
    ct = _compute_dtype(q.dtype)
    qg, kf, vf = _grouped(q, g).to(ct), k.to(ct), v.to(ct)
    dog, og = _grouped(dout, g).to(ct), _grouped(out, g).to(ct)
    lseg = lse.to(ct).reshape(b, g, n // g, sq)
    dq = torch.empty_like(qg)
    dk = torch.zeros(b, g, sk, d, dtype=ct, device=q.device)
    dv = torch.zeros_like(dk)
    for start, end in _tiles(b, n, sq, sk):
        qt, dot = qg[:, :, :, start:end], dog[:, :, :, start:end]
        p = torch.exp(_scores(qt, kf, start, causal, scale) - lseg[..., start:end, None])
        dv += torch.matmul(p.transpose(-1, -2), dot).sum(2)
        dp = torch.matmul(dot, vf.unsqueeze(2).transpose(-1, -2))
        delta = (dot * og[:, :, :, start:end]).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq[:, :, :, start:end] = torch.matmul(ds, kf.unsqueeze(2))
        dk += torch.matmul(ds.transpose(-1, -2), qt).sum(2)
    return dq.reshape(b, n, sq, d), dk, dv
