"""A KV cache in fixed-size blocks, and the attention of one step's requests over their own
blocks (vLLM's paged attention, Kwon et al. 2023).

Shapes: B = blocks in the pool, S = ``block_size``, g = key/value groups of this tensor-parallel
rank, d = head width, n = query heads of this rank, s = tokens of a request this step,
L = that request's cached positions after the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.model.attention_mask import AttentionMask, masked_attention


class PagedKVCache:
    """Per layer, keys and values ``[B, S, g, d]`` (allocated at a layer's first use, in the dtype
    and on the device of its keys). A request's position ``p`` lives in block
    ``table[p // S]``, row ``p % S``."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def storage(self, layer_number: int, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``(keys, values)`` pools, shaped after ``like [s, b, g, d]``."""
        if layer_number not in self.layers:
            shape = (self.num_blocks, self.block_size) + tuple(like.shape[2:])
            self.layers[layer_number] = (like.new_zeros(shape), like.new_zeros(shape))
        return self.layers[layer_number]

    def nbytes(self) -> int:
        """Bytes the allocated layers take on this rank."""
        return sum(k.nbytes + v.nbytes for k, v in self.layers.values())


@dataclass(frozen=True)
class Segment:
    """One request's tokens in a step's packed sequence: rows ``[offset, offset + length)`` hold
    its positions ``[position, position + length)``; ``blocks`` is its block table."""

    offset: int
    length: int
    position: int
    blocks: Tuple[int, ...]


class PagedStep:
    """The ``inference_params`` of one forward over packed requests ``[1, sum(lengths)]``:
    each layer's attention (``megatron.model.attention``) hands its queries, keys and values to
    :meth:`attend`, which stores the keys/values in each request's blocks and attends each
    request to its own positions only, with the same shapes whatever else runs in the step."""

    def __init__(self, cache: PagedKVCache, segments: Sequence[Segment]):
        self.cache = cache
        self.segments = list(segments)

    def attend(self, layer_number: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
        """``q [s, 1, n, d]``, ``k, v [s, 1, g, d]`` (after rotary) -> ``[s, 1, n, d]``.

        ``chunk_size`` C (Llama 4's RoPE layers, ``--attention-chunk-size``): a query at position
        ``p`` attends causally to the positions of its own chunk ``p // C`` only, as
        :func:`megatron.model.chunked_attention.chunked_cache_mask` does for the contiguous
        cache; only the blocks holding that chunk's positions are gathered, so no mask or keys
        wider than C are made. None: the whole causal context.

        Raises:
            ValueError: a batch dimension other than 1 (requests are packed along the sequence).
        """
        if q.shape[1] != 1:
            raise ValueError(f"a paged step packs requests along the sequence (batch 1, got {q.shape[1]})")
        k_pool, v_pool = self.cache.storage(layer_number, k)
        size = self.cache.block_size
        outs: List[torch.Tensor] = []
        for seg in self.segments:
            table = torch.tensor(seg.blocks, dtype=torch.long, device=k.device)
            pos = torch.arange(seg.position, seg.position + seg.length, device=k.device)
            rows = slice(seg.offset, seg.offset + seg.length)
            k_pool[table[pos // size], pos % size] = k[rows, 0]
            v_pool[table[pos // size], pos % size] = v[rows, 0]
            for first, stop, start in _key_spans(seg.position, seg.length, chunk_size):
                queries = q[seg.offset + first - seg.position:seg.offset + stop - seg.position]
                outs.append(self._attend_span(queries, k_pool, v_pool, table, start, first, stop))
        return torch.cat(outs, dim=0)

    def _attend_span(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     table: torch.Tensor, start: int, first: int, stop: int) -> torch.Tensor:
        """Queries ``q [stop - first, 1, n, d]`` at positions ``[first, stop)`` over the cached
        keys ``[start, stop)`` of one request (its block ``table``), causally -> ``[stop - first,
        1, n, d]``."""
        size = self.cache.block_size
        lo = start // size
        used = table[lo:-(-stop // size)]
        keys = k_pool[used].flatten(0, 1)[start - lo * size:stop - lo * size]  # [L, g, d]
        values = v_pool[used].flatten(0, 1)[start - lo * size:stop - lo * size]
        # Always the dense mask (never SDPA's is_causal path), so a request's first chunk
        # takes the same kernel as its later ones.
        q_pos = torch.arange(first, stop, device=q.device)
        mask = torch.arange(start, stop, device=q.device)[None, :] > q_pos[:, None]  # [s, L]
        out = masked_attention(q.permute(1, 2, 0, 3), keys.permute(1, 0, 2)[None],
                               values.permute(1, 0, 2)[None],
                               AttentionMask.from_dense(mask[None, None]))
        return out.permute(2, 0, 1, 3)  # [s, 1, n, d]


def _key_spans(position: int, length: int, chunk_size: Optional[int]) -> List[Tuple[int, int, int]]:
    """The query positions ``[position, position + length)`` cut at chunk boundaries:
    ``[(first, stop, start)]``, queries ``[first, stop)`` attending to keys ``[start, stop)``
    (``start`` 0 without chunks, else the chunk's first position)."""
    end = position + length
    if chunk_size is None:
        return [(position, end, 0)]
    spans = []
    first = position
    while first < end:
        start = first - first % chunk_size
        stop = min(end, start + chunk_size)
        spans.append((first, stop, start))
        first = stop
    return spans
