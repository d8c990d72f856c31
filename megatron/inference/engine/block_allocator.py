"""Fixed-size KV-cache blocks handed out from a free list (vLLM's paged attention,
Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention")."""

from __future__ import annotations

from typing import List


def blocks_needed(tokens: int, block_size: int) -> int:
    """Blocks holding ``tokens`` positions: ``ceil(tokens / block_size)``."""
    return -(-tokens // block_size)


def bytes_per_block(block_size: int, layers: int, groups: int, kv_channels: int,
                    dtype_bytes: int) -> int:
    """Bytes one block takes on one rank: keys and values of ``block_size`` positions for each of
    this rank's ``layers`` and ``groups`` key/value heads of ``kv_channels`` elements."""
    return 2 * block_size * layers * groups * kv_channels * dtype_bytes


class BlockAllocator:
    """A pool of ``num_blocks`` block ids with a free list (lowest ids first, so the ids a run
    hands out are reproducible).

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block (got {num_blocks})")
        self.num_blocks = num_blocks
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> List[int]:
        """Take ``n`` blocks. Raises RuntimeError when fewer are free (admission control checks
        :meth:`can_allocate` first)."""
        if n > len(self._free):
            raise RuntimeError(f"{n} KV-cache blocks asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: List[int]) -> None:
        """Give ``blocks`` back (they are handed out again lowest id first)."""
        self._free.extend(blocks)
        self._free.sort(reverse=True)
