"""Iteration-level scheduling (Orca, Yu et al. OSDI 2022; vLLM): at every step requests are
admitted into the running batch and finished ones leave it.

Policy: first come, first served. A request is admitted when the batch has a free slot
(``max_batch_size``) and the KV cache has free blocks for its prompt plus ``max_tokens``
(reserved at admission, so a running request never waits for memory and nothing is preempted).
Each step then takes every running request's next piece while the step's token budget
(``max_tokens_per_step``) lasts, decodes (1 token each) first: a request in prefill feeds its
next ``prefill_chunk`` prompt tokens (chunked prefill, Agrawal et al. 2023, Sarathi), a decoding
request its last generated token. A piece is never cut to fit the budget: a request's pieces are
the same whether it runs alone or among others.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional

from megatron.inference.engine.block_allocator import BlockAllocator, blocks_needed
from megatron.inference.engine.sampling_params import SamplingParams


@dataclass
class Request:
    """One request's state on the scheduling rank.

    Attributes:
        computed: positions whose keys/values are in the cache.
        finish_reason: None while running; ``"stop"`` (end of document or a stop string) or
            ``"length"`` (``max_tokens`` reached).
        first_token_time / finish_time: ``time.perf_counter()`` seconds.
    """

    rid: int
    prompt: List[int]
    params: SamplingParams
    blocks: List[int] = field(default_factory=list)
    computed: int = 0
    output: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    top_logprobs: List[tuple] = field(default_factory=list)  # per token: ((id, logprob), ...)
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None

    @property
    def need(self) -> int:
        """Cache positions reserved: prompt + ``max_tokens``."""
        return len(self.prompt) + self.params.max_tokens

    def next_piece(self, prefill_chunk: int):
        """``(tokens, position, samples)``: what this request feeds next and whether its last
        row's logits give a new token."""
        if self.computed < len(self.prompt):
            end = min(self.computed + prefill_chunk, len(self.prompt))
            return self.prompt[self.computed:end], self.computed, end == len(self.prompt)
        return [self.output[-1]], self.computed, True


@dataclass(frozen=True)
class PlanEntry:
    """One request's part of a step (what every rank needs to run it)."""

    rid: int
    tokens: List[int]
    position: int
    blocks: tuple
    sample: Optional[SamplingParams]  # None: a prefill chunk that is not the prompt's last


class Scheduler:
    """Admission and per-step selection over a :class:`BlockAllocator`.

    ``static``: request-level batching instead (a batch is admitted into an empty engine and
    runs until its last request finishes), for comparison.

    Raises (``__init__``):
        ValueError: a budget smaller than one prefill chunk, or a size < 1.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, *, max_batch_size: int = 8,
                 max_tokens_per_step: int = 256, prefill_chunk: int = 64, static: bool = False):
        if min(max_batch_size, max_tokens_per_step, prefill_chunk) < 1:
            raise ValueError("max_batch_size, max_tokens_per_step and prefill_chunk must be >= 1")
        if max_tokens_per_step < prefill_chunk:
            raise ValueError(f"max_tokens_per_step ({max_tokens_per_step}) must hold one prefill "
                             f"chunk ({prefill_chunk})")
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_tokens_per_step = max_tokens_per_step
        self.prefill_chunk = prefill_chunk
        self.static = static
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []

    def capacity_error(self, request: Request) -> Optional[str]:
        """Why ``request`` can never be admitted (more blocks than the whole cache), or None."""
        need = blocks_needed(request.need, self.block_size)
        if need > self.allocator.num_blocks:
            return (f"prompt ({len(request.prompt)} tokens) + max_tokens "
                    f"({request.params.max_tokens}) needs {need} KV-cache blocks of "
                    f"{self.block_size}; the cache has {self.allocator.num_blocks}")
        return None

    def admit(self) -> None:
        if self.static and self.running:
            return  # request-level batching: the next batch starts when this one has finished
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            need = blocks_needed(request.need, self.block_size)
            if not self.allocator.can_allocate(need):
                break
            request.blocks = self.allocator.allocate(need)
            self.running.append(self.waiting.popleft())

    def plan(self) -> List[PlanEntry]:
        """Admit, then this step's pieces (decodes first, then prefill chunks, admission order)."""
        self.admit()
        budget = self.max_tokens_per_step
        decoding = [r for r in self.running if r.computed >= len(r.prompt)]
        prefilling = [r for r in self.running if r.computed < len(r.prompt)]
        entries = []
        for request in decoding + prefilling:
            tokens, position, samples = request.next_piece(self.prefill_chunk)
            if len(tokens) > budget:
                continue
            budget -= len(tokens)
            entries.append(PlanEntry(request.rid, tokens, position, tuple(request.blocks),
                                     request.params if samples else None))
        return entries

    def finish(self, request: Request) -> None:
        """Take ``request`` out of the batch and free its blocks."""
        self.running.remove(request)
        self.allocator.release(request.blocks)
        request.blocks = []
        request.finish_time = time.perf_counter()
