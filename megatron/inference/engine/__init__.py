"""Continuous-batching inference over a paged KV cache (``engine.Engine``)."""

from megatron.inference.engine.block_allocator import BlockAllocator, blocks_needed, bytes_per_block
from megatron.inference.engine.engine import Engine, TokenEvent
from megatron.inference.engine.sampling_params import SamplingParams

__all__ = ["BlockAllocator", "Engine", "SamplingParams", "TokenEvent", "blocks_needed",
           "bytes_per_block"]
