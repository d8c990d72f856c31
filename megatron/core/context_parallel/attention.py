"""Exact causal attention over a sequence split across the context-parallel group.

Every rank holds the queries, keys and values of its two chunks of the load-balanced split
(:mod:`megatron.core.context_parallel.split`: chunks ``i`` and ``2 CP - 1 - i`` of ``c`` tokens
each, local length ``2c``). Two ways to let its queries see every earlier key
(``--cp-comm-type``, Megatron-Core's names):

* ``p2p``: ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; the
  zig-zag variant of TransformerEngine). In ``CP`` steps each rank's key/value block travels
  once around the ring (send to the next context-parallel rank, receive from the previous),
  the transfer of the next block overlapping the attention on the current one. At step ``j``
  rank ``i`` holds the block of rank ``r = i - j (mod CP)``: at ``j = 0`` its own (causal);
  for ``r < i`` both its chunks see the first chunk of ``r`` entirely and the second not at all;
  for ``r > i`` only its second chunk sees, and sees both chunks of ``r`` entirely. So only
  square causal blocks or unmasked rectangles occur, and every rank does the same work. The
  block results are merged by their log-sum-exp in fp32 (online softmax). Backward sends the
  key/value blocks around the ring again, and with each block the fp32 sum of its ``dK``/``dV``
  so far, which reaches its owner after the last step.
* ``all_gather``: Llama 3's context parallelism (Dubey et al. 2024, "The Llama 3 Herd of Models",
  section 3.3.2): all-gather the keys and values of the whole sequence, then each local chunk
  attends to its own chunk (causal) and to every earlier one (unmasked), merged by log-sum-exp.
  Backward gathers them again (nothing of the whole sequence is kept between the passes) and
  reduce-scatters the fp32 ``dK``/``dV`` back to their owners.

Both equal unsplit softmax attention to rounding, forward and backward (the merge is the online
softmax FlashAttention applies inside its kernel), for grouped-query attention too.
Per-rank memory kept for backward is that of the local chunks: ``q, k, v``, the output and its
fp32 log-sum-exp. Attention dropout is not supported (the training arguments refuse
``--attention-dropout`` > 0 with ``--context-parallel-size`` > 1).

Document masks (packed sequences, ``--reset-attention-mask``): :class:`DocumentAttention`, the
all-gather exchange with each query attending only to its document's keys, which may lie in
other ranks' chunks (a document crosses chunk boundaries of the split freely).

Shapes: b = micro-batch, n = query heads (of this tensor-parallel rank), g = key/value groups,
s = local sequence ``2c`` (``s_total / CP``), d = head width. Tensors are ``[b, heads, s, d]``.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.context_parallel.block_attention import (attention_block_backward,
                                                            attention_block_forward)
from megatron.core.distributed.collectives import tensor_all_gather, tensor_reduce_scatter

CP_COMM_TYPES = ("p2p", "all_gather")

# gloo matches sends and receives between two ranks by tag: keys/values and their gradients
# travel at the same time in backward (NCCL ignores tags and matches in issue order, which is
# the same on both sides).
_KV_TAG, _DKV_TAG = 71, 72


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
            block_lse: torch.Tensor) -> None:
    """Fold one block's ``(out, lse)`` into the running fp32 ``(out, lse)`` of the same rows, in
    place: ``out = out e^(lse - new) + block e^(block_lse - new)``, ``new = logaddexp``."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Ring:
    """This rank's neighbours in the context-parallel ring and one exchange step."""

    def __init__(self, group):
        ranks: List[int] = dist.get_process_group_ranks(group)
        self.group, self.size, self.rank = group, len(ranks), _rank(group)
        self.next = ranks[(self.rank + 1) % self.size]
        self.prev = ranks[(self.rank - 1) % self.size]

    def exchange(self, send: torch.Tensor, tag: int):
        """Start sending ``send`` to the next rank and receiving its like from the previous one.

        Returns ``(receive buffer, requests, send)``: wait on the requests before reading the
        buffer; the tuple keeps ``send`` alive until then (the backend may still be reading it)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops), send


def _keep_for_backward(ctx, q, k, v, out, lse, group, scale) -> torch.Tensor:
    """Save what both backward passes read (the local chunks, the merged output and its
    log-sum-exp; nothing of the other ranks) and return ``out``."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.group, ctx.scale = group, scale
    return out


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _ring_block(rank: int, source: int, c: int):
    """``(query rows, key rows, causal)`` of what ``rank``'s chunks see of ``source``'s: all of
    its own (causal), all queries against the first chunk of an earlier rank, the second chunk's
    queries against both chunks of a later rank (module docstring)."""
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


class RingAttention(torch.autograd.Function):
    """Causal attention with the ring (``p2p``) exchange of key/value blocks; see the module
    docstring. ``apply(q, k, v, group, scale)``; collective: point-to-point sends and receives
    over ``group``, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        ring = _Ring(group)
        c = q.shape[2] // 2
        kv = torch.stack([k, v])
        out = lse = None
        for step in range(ring.size):
            pending = ring.exchange(kv, _KV_TAG) if step + 1 < ring.size else None
            rows, keys, causal = _ring_block(ring.rank, (ring.rank - step) % ring.size, c)
            block, block_lse = attention_block_forward(q[:, :, rows], kv[0, :, :, keys],
                                                       kv[1, :, :, keys], causal, scale)
            if step == 0:  # the diagonal block: every row, the running result starts here
                out, lse = block.to(_accumulation_dtype(q.dtype)), block_lse.clone()
            else:
                _merge_(out[:, :, rows], lse[:, :, rows], block, block_lse)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        return _keep_for_backward(ctx, q, k, v, out.to(q.dtype), lse, group, scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = _Ring(ctx.group), ctx.scale
        c = q.shape[2] // 2
        acc = _accumulation_dtype(q.dtype)
        kv = torch.stack([k, v])
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv_pending = None
        for step in range(ring.size):
            pending = ring.exchange(kv, _KV_TAG) if step + 1 < ring.size else None
            rows, keys, causal = _ring_block(ring.rank, (ring.rank - step) % ring.size, c)
            dq_, dk_, dv_ = attention_block_backward(
                dout[:, :, rows], q[:, :, rows], kv[0, :, :, keys], kv[1, :, :, keys],
                out[:, :, rows], lse[:, :, rows], causal, scale)
            dq[:, :, rows] += dq_
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            dkv[0, :, :, keys] += dk_
            dkv[1, :, :, keys] += dv_
            if dkv_pending is not None:
                # The previous rank's partial sum for this same block, sent at its last step.
                _wait(dkv_pending[1])
                dkv += dkv_pending[0]
            dkv_pending = ring.exchange(dkv, _DKV_TAG)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        _wait(dkv_pending[1])
        dkv = dkv_pending[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _gather_sequence(kv: torch.Tensor, group, cp: int) -> torch.Tensor:
    """All-gather ``kv [2, b, g, 2c, d]`` of every rank and put the chunks in sequence order:
    ``[2, b, g, 2 CP c, d]``."""
    if cp == 1:
        return kv
    gathered = torch.empty((cp * kv.shape[0],) + tuple(kv.shape[1:]), dtype=kv.dtype,
                           device=kv.device)
    tensor_all_gather(gathered, kv.contiguous(), group=group)
    _, b, g, s, d = kv.shape
    c = s // 2
    halves = gathered.view(cp, 2, b, g, 2, c, d)
    chunks = [halves[t, :, :, :, 0] if t < cp else halves[2 * cp - 1 - t, :, :, :, 1]
              for t in range(2 * cp)]
    return torch.cat(chunks, dim=3)


def _scatter_sequence(dkv: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Inverse of :func:`_gather_sequence` for gradients: reduce-scatter (sum) the
    ``[2, b, g, 2 CP c, d]`` sequence-ordered ``dkv`` back to each rank's two chunks."""
    if cp == 1:
        return dkv
    two, b, g, s, d = dkv.shape
    c = s // (2 * cp)
    chunks = dkv.view(two, b, g, 2 * cp, c, d)
    per_rank = torch.stack([torch.cat([chunks[:, :, :, r], chunks[:, :, :, 2 * cp - 1 - r]], dim=3)
                            for r in range(cp)])  # [CP, 2, b, g, 2c, d]
    mine = torch.empty((two, b, g, 2 * c, d), dtype=dkv.dtype, device=dkv.device)
    tensor_reduce_scatter(mine, per_rank.view(cp * two, b, g, 2 * c, d), group=group)
    return mine


def _local_chunks(cp: int, rank: int, c: int):
    """``(local rows, global chunk index)`` of this rank's two chunks."""
    return ((slice(0, c), rank), (slice(c, 2 * c), 2 * cp - 1 - rank))


class AllGatherAttention(torch.autograd.Function):
    """Causal attention with all-gathered keys and values (``all_gather``); see the module
    docstring. ``apply(q, k, v, group, scale)``; collective: all-gather over ``group`` in forward,
    all-gather and reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        cp, rank = _size(group), _rank(group)
        c = q.shape[2] // 2
        kv = _gather_sequence(torch.stack([k, v]), group, cp)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=_accumulation_dtype(q.dtype), device=q.device)
        for rows, t in _local_chunks(cp, rank, c):
            qc = q[:, :, rows]
            block, block_lse = attention_block_forward(qc, kv[0, :, :, t * c:(t + 1) * c],
                                                       kv[1, :, :, t * c:(t + 1) * c], True, scale)
            if t == 0:
                out[:, :, rows], lse[:, :, rows] = block, block_lse
                continue
            merged, merged_lse = block.to(lse.dtype), block_lse.to(lse.dtype)
            prefix, prefix_lse = attention_block_forward(qc, kv[0, :, :, :t * c],
                                                         kv[1, :, :, :t * c], False, scale)
            _merge_(merged, merged_lse, prefix, prefix_lse)
            out[:, :, rows], lse[:, :, rows] = merged, merged_lse
        return _keep_for_backward(ctx, q, k, v, out, lse, group, scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = _size(group), _rank(group)
        c = q.shape[2] // 2
        acc = _accumulation_dtype(q.dtype)
        kv = _gather_sequence(torch.stack([k, v]), group, cp)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        for rows, t in _local_chunks(cp, rank, c):
            args = (dout[:, :, rows], q[:, :, rows])
            kept = (out[:, :, rows], lse[:, :, rows])
            own = slice(t * c, (t + 1) * c)
            dq_, dk_, dv_ = attention_block_backward(*args, kv[0, :, :, own], kv[1, :, :, own],
                                                     *kept, True, scale)
            dq[:, :, rows] += dq_
            dkv[0, :, :, own] += dk_
            dkv[1, :, :, own] += dv_
            if t > 0:
                dq_, dk_, dv_ = attention_block_backward(*args, kv[0, :, :, :t * c],
                                                         kv[1, :, :, :t * c], *kept, False, scale)
                dq[:, :, rows] += dq_
                dkv[0, :, :, :t * c] += dk_
                dkv[1, :, :, :t * c] += dv_
        mine = _scatter_sequence(dkv, group, cp)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None


def _documents(ids: torch.Tensor) -> List[tuple]:
    """``[(start, end), ...]`` of the contiguous runs of equal ids of one row ``[S]``."""
    _, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    return list(zip([0] + ends[:-1], ends))


def _document_blocks(documents, cp: int, rank: int, c: int):
    """``(local query rows, global key columns, causal)`` of one row under document masks.

    For each local chunk and each document ``[ds, de)`` that meets it in ``[lo, hi)``: the
    queries ``lo..hi-1`` see the document's keys ``ds..lo-1`` entirely (an unmasked
    rectangle, when the document began in an earlier chunk) and keys ``lo..hi-1`` causally (a
    square diagonal block). Documents that cross chunk boundaries are thus split into blocks
    of the two shapes the block kernel does; no key of another document is read.
    """
    blocks = []
    chunks = _local_chunks(cp, rank, c) if cp > 1 else ((slice(0, c), 0),)
    for rows, t in chunks:
        a, e = t * c, (t + 1) * c
        for ds, de in documents:
            lo, hi = max(a, ds), min(e, de)
            if lo >= hi:
                continue
            local = slice(rows.start + lo - a, rows.start + hi - a)
            blocks.append((local, slice(lo, hi), True))
            if ds < lo:
                blocks.append((local, slice(ds, lo), False))
    return blocks


class DocumentAttention(torch.autograd.Function):
    """Causal attention within documents over the split sequence, with all-gathered keys and
    values: ``apply(q, k, v, document_ids, group, scale)``. Each row's queries attend to the
    blocks of :func:`_document_blocks`, merged by log-sum-exp; backward gathers keys and values
    again and reduce-scatters ``dK``/``dV`` as :class:`AllGatherAttention`. Used for
    ``--reset-attention-mask`` under either ``--cp-comm-type``: the ring's fixed schedule of
    which block each step holds assumes plain causal structure."""

    @staticmethod
    def forward(ctx, q, k, v, document_ids, group, scale):
        cp, rank = _size(group), _rank(group)
        c = q.shape[2] // 2 if cp > 1 else q.shape[2]
        acc = _accumulation_dtype(q.dtype)
        kv = _gather_sequence(torch.stack([k, v]), group, cp)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        blocks = [_document_blocks(_documents(document_ids[r]), cp, rank, c)
                  for r in range(q.shape[0])]
        for r, row_blocks in enumerate(blocks):
            one = slice(r, r + 1)
            for rows, keys, causal in row_blocks:
                block, block_lse = attention_block_forward(q[one, :, rows], kv[0, one, :, keys],
                                                           kv[1, one, :, keys], causal, scale)
                _merge_(out[one, :, rows], lse[one, :, rows], block, block_lse)
        ctx.blocks = blocks
        return _keep_for_backward(ctx, q, k, v, out.to(q.dtype), lse, group, scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp = _size(group)
        acc = _accumulation_dtype(q.dtype)
        kv = _gather_sequence(torch.stack([k, v]), group, cp)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        for r, row_blocks in enumerate(ctx.blocks):
            one = slice(r, r + 1)
            for rows, keys, causal in row_blocks:
                dq_, dk_, dv_ = attention_block_backward(
                    dout[one, :, rows], q[one, :, rows], kv[0, one, :, keys], kv[1, one, :, keys],
                    out[one, :, rows], lse[one, :, rows], causal, scale)
                dq[one, :, rows] += dq_
                dkv[0, one, :, keys] += dk_
                dkv[1, one, :, keys] += dv_
        mine = _scatter_sequence(dkv, group, cp)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                               comm_type: str = "p2p",
                               scale: Optional[float] = None,
                               document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal softmax attention of this rank's chunks over the whole split sequence, within
    documents when ``document_ids`` are given.

    Args:
        q: ``[b, n, s, d]`` queries of this rank's two chunks (RoPE applied at their true
            positions), ``s = s_total / CP`` even.
        k, v: ``[b, g, s, d]`` (n divisible by g), same dtype and device.
        group: the context-parallel ``torch.distributed`` group; None (a world of one) or a
            group of one runs plain causal attention.
        comm_type: ``"p2p"`` (ring) or ``"all_gather"`` (``--cp-comm-type``).
        scale: softmax scale, default ``1 / sqrt(d)``.
        document_ids: None (causal), or int64 ``[b, s_total]`` of the whole sequence: a query
            attends causally to keys of its own document only (``--reset-attention-mask``;
            contiguous, non-decreasing ids). Runs :class:`DocumentAttention` (all-gather) for
            either ``comm_type``.

    Returns:
        ``[b, n, s, d]`` in q's dtype: equal, to rounding, to the rows of unsplit causal
        attention that this rank holds; differentiable (see the two autograd functions).

    Raises:
        ValueError: an unknown ``comm_type``, an odd local length, or document ids not of
            the whole sequence.
    """
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if _size(group) == 1 and document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    if q.shape[2] % 2 and _size(group) > 1:
        raise ValueError(f"a context-parallel rank holds two chunks of equal length; got an odd "
                         f"local sequence length {q.shape[2]}")
    if document_ids is not None:
        if tuple(document_ids.shape) != (q.shape[0], q.shape[2] * _size(group)):
            raise ValueError(f"document ids {tuple(document_ids.shape)} must be [b, s_total] = "
                             f"[{q.shape[0]}, {q.shape[2] * _size(group)}]: the ids of the whole "
                             "sequence, not of this rank's chunks")
        return DocumentAttention.apply(q, k, v, document_ids, group, scale)
    function = RingAttention if comm_type == "p2p" else AllGatherAttention
    return function.apply(q, k, v, group, scale)
