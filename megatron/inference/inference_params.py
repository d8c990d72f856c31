"""Key/value cache for incremental decoding (Megatron-LM's ``InferenceParams``).

Shapes: s = new tokens this step, b = batch, g = key/value groups of this tensor-parallel rank,
d = head width, L = ``sequence_len_offset + s`` (cached plus new positions).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


class InferenceParams:
    """Per-layer key/value caches of one generation batch.

    The caller runs the model on tokens ``[offset, offset + s)`` with ``position_ids`` of those
    positions, then advances ``sequence_len_offset`` by ``s`` (as Megatron-LM's text generation).

    Args:
        max_batch_size: sequences in the batch.
        max_sequence_length: longest prompt + generated length (cache rows).
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.key_value_memory_dict: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def append_kv(self, layer_number: int, key: torch.Tensor, value: torch.Tensor):
        """Store ``key, value [s, b, g, d]`` (after rotary) at the current offset of this layer's
        cache; return the cached ``[L, b, g, d]`` keys and values.

        Raises:
            ValueError: the step would run past ``max_sequence_length`` or ``max_batch_size``.
        """
        s, b = key.shape[:2]
        start = self.sequence_len_offset
        if start + s > self.max_sequence_length or b > self.max_batch_size:
            raise ValueError(f"KV cache of {self.max_batch_size} x {self.max_sequence_length} "
                             f"cannot hold positions up to {start + s} for a batch of {b}")
        if layer_number not in self.key_value_memory_dict:
            shape = (self.max_sequence_length, self.max_batch_size) + tuple(key.shape[2:])
            self.key_value_memory_dict[layer_number] = (
                key.new_empty(shape), value.new_empty(shape))
        k_cache, v_cache = self.key_value_memory_dict[layer_number]
        k_cache[start:start + s, :b] = key
        v_cache[start:start + s, :b] = value
        return k_cache[:start + s, :b], v_cache[:start + s, :b]

    def attention_mask(self, s: int, device) -> Optional[torch.Tensor]:
        """None (plain causal) on the first step; afterwards bool ``[1, 1, s, L]`` with True where
        a new query at position ``offset + i`` may not see key ``j > offset + i``."""
        offset = self.sequence_len_offset
        if offset == 0:
            return None
        q_pos = torch.arange(offset, offset + s, device=device)[:, None]
        k_pos = torch.arange(offset + s, device=device)[None, :]
        return (k_pos > q_pos)[None, None]
