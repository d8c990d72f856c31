"""A KV cache in fixed-size blocks, and the attention of one step's requests over their own
blocks (vLLM's paged attention, Kwon et al. 2023).

Shapes: B = blocks in the pool, S = ``block_size``, g = key/value groups of this tensor-parallel
rank, d = head width, n = query heads of this rank, s = tokens of a request this step,
L = that request's cached positions after the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

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
               v: torch.Tensor) -> torch.Tensor:
        """``q [s, 1, n, d]``, ``k, v [s, 1, g, d]`` (after rotary) -> ``[s, 1, n, d]``.

        Raises:
            ValueError: a batch dimension other than 1 (requests are packed along the sequence).
        """
        if q.shape[1] != 1:
            raise ValueError(f"a paged step packs requests along the sequence (batch 1, got {q.shape[1]})")
        k_pool, v_pool = self.cache.storage(layer_number, k)
        size = self.cache.block_size
        outs: List[torch.Tensor] = []
        for seg in self.segments:
            rows = slice(seg.offset, seg.offset + seg.length)
            table = torch.tensor(seg.blocks, dtype=torch.long, device=k.device)
            pos = torch.arange(seg.position, seg.position + seg.length, device=k.device)
            k_pool[table[pos // size], pos % size] = k[rows, 0]
            v_pool[table[pos // size], pos % size] = v[rows, 0]
            end = seg.position + seg.length
            used = table[:-(-end // size)]
            keys = k_pool[used].flatten(0, 1)[:end]  # [L, g, d]
            values = v_pool[used].flatten(0, 1)[:end]
            # Always the dense mask (never SDPA's is_causal path), so a request's first chunk
            # takes the same kernel as its later ones.
            mask = torch.arange(end, device=k.device)[None, :] > pos[:, None]  # [s, L]
            out = masked_attention(q[rows].permute(1, 2, 0, 3), keys.permute(1, 0, 2)[None],
                                   values.permute(1, 0, 2)[None],
                                   AttentionMask.from_dense(mask[None, None]))
            outs.append(out.permute(2, 0, 1, 3))  # [s, 1, n, d]
        return torch.cat(outs, dim=0)
