"""The inference engine: continuous batching over a paged KV cache, at any TP x PP layout.

Model-parallel rank 0 schedules (:class:`~megatron.inference.engine.scheduler.Scheduler`) and
broadcasts each step's plan over the model-parallel group; every rank runs the plan's forward;
the last stage samples each request with its own generator and shares the tokens and
log-probabilities back (tensor-parallel rank 0 of the last stage, then the pipeline group).

Batch invariance: a request's pieces (prefill chunks, then one token per step) and its
attention (over its own blocks, :class:`~megatron.inference.engine.paged_kv_cache.PagedStep`)
do not depend on the other requests. With ``packed=False`` (the default) each request's piece
runs as its own forward, so every operation sees the same shapes and its tokens and
log-probabilities are bitwise those of the request run alone. With ``packed=True`` one forward
carries all pieces of the step: faster, but CPU/GPU matrix products choose their blocking by the
row count, so log-probabilities agree to fp32 rounding only (and greedy tokens except at
near-ties).

Mixture of experts: at expert-parallel size EP > 1 the EP ranks (data-parallel ranks of the
dense layers) all run every step on the same tokens, the plan broadcast over the whole world;
each dispatches its copy of the tokens to the experts' ranks and gets back its own tokens'
outputs. Routing in inference is dropless (``model_loader.moe_config_for_inference``): a token's
experts and weights depend on that token alone, so batch invariance holds as for a dense model
(bitwise per-request forwards, fp32 rounding packed); at EP > 1 an expert's matrix product has
the rows of every EP rank, so EP = 2 equals EP = 1 to fp32 rounding.

Scoring (:meth:`Engine.score`, the lm-evaluation-harness backend's log-likelihoods): a step of
its own, one full forward per sequence without cache, broadcast and followed as a plan.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.inference.engine.block_allocator import BlockAllocator
from megatron.inference.engine.paged_kv_cache import PagedKVCache, PagedStep, Segment
from megatron.inference.engine.sampling_params import SamplingParams
from megatron.inference.engine.scheduler import PlanEntry, Request, Scheduler
from megatron.inference.forward import forward_logits
from megatron.inference.generation import _share_from_last_stage, sample


@dataclass(frozen=True)
class TokenEvent:
    """A token a step produced for request ``rid`` (``finish_reason`` set on its last one)."""

    rid: int
    token: int
    logprob: float
    finish_reason: Optional[str]
    top: Tuple[Tuple[int, float], ...] = ()
    """``(id, log-probability)`` of the request's ``top_logprobs`` most likely tokens at this
    position, most likely first (empty when it asked for none)."""


class Engine:
    """Continuous-batching generation for one model replica (data-parallel size 1).

    Args:
        model: this rank's stage (``LlamaModel``), in eval mode.
        pg_collection: this rank's process groups.
        num_blocks / block_size: the KV cache (see ``block_allocator.bytes_per_block`` for the
            bytes a block takes).
        max_batch_size, max_tokens_per_step, prefill_chunk: the scheduler's limits.
        vocab_size: the true vocabulary (padding ids are never sampled); default the model's.
        eod: end-of-document id (ends a request whose ``stop_at_eod``), or None.
        detokenize: ids -> text, for stop strings (scheduling rank only).
        packed: one forward per step for all requests (see the module docstring).
        static: request-level batching (admit only into an empty batch) for comparison.

    Raises:
        ValueError: data-parallel replicas other than the expert-parallel ranks (data-parallel
            size > 1 and not equal to the expert-parallel size), or bad limits.
    """

    def __init__(self, model, pg_collection, *, num_blocks: int, block_size: int = 16,
                 max_batch_size: int = 8, max_tokens_per_step: int = 256,
                 prefill_chunk: int = 64, vocab_size: Optional[int] = None,
                 eod: Optional[int] = None, detokenize: Optional[Callable] = None,
                 packed: bool = False, static: bool = False, device=None):
        if pg_collection.dp.size > 1 and pg_collection.dp.size != pg_collection.ep.size:
            raise ValueError("the engine serves one model replica: launch TP x PP (x EP) "
                             f"processes (data-parallel size {pg_collection.dp.size} given, "
                             f"expert-parallel size {pg_collection.ep.size})")
        self.model = model
        self.groups = pg_collection
        self.cache = PagedKVCache(num_blocks, block_size)
        self.scheduler = Scheduler(BlockAllocator(num_blocks), block_size,
                                   max_batch_size=max_batch_size,
                                   max_tokens_per_step=max_tokens_per_step,
                                   prefill_chunk=prefill_chunk, static=static)
        self.vocab_size = (vocab_size or model.config.true_vocab_size
                           or model.config.padded_vocab_size)
        self.eod = eod
        self.detokenize = detokenize
        self.packed = packed
        self.device = device
        self.requests: Dict[int, Request] = {}
        self._ids = itertools.count()
        self._generators: Dict[int, torch.Generator] = {}
        self._to_free: List[int] = []

    # -- the scheduling rank ---------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.groups.model.rank <= 0 and self.groups.dp.rank <= 0

    def add_request(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; returns its id (scheduling rank only).

        Raises:
            ValueError: an empty prompt, ids outside the vocabulary, prompt + max_tokens beyond
                ``max_position_embeddings`` or beyond the whole KV cache.
        """
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        limit = self.model.config.max_position_embeddings
        if len(prompt) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the model's context of {limit} positions")
        request = Request(next(self._ids), prompt, params)
        error = self.scheduler.capacity_error(request)
        if error:
            raise ValueError(error)
        self.requests[request.rid] = request
        self.scheduler.waiting.append(request)
        return request.rid

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def step(self) -> List[TokenEvent]:
        """One iteration: schedule, run, sample, retire finished requests (scheduling rank;
        the other ranks run :meth:`follow` meanwhile)."""
        entries = self.scheduler.plan()
        plan = {"free": self._to_free, "entries": entries}
        self._to_free = []
        self._broadcast(plan)
        sampled = self._execute(plan)
        events = []
        for entry, (token, logprob, top) in zip([e for e in entries if e.sample is not None],
                                                sampled):
            request = self.requests[entry.rid]
            request.computed += len(entry.tokens)
            events.append(self._accept(request, token, logprob, top))
        for entry in entries:
            if entry.sample is None:
                self.requests[entry.rid].computed += len(entry.tokens)
        return events

    def _accept(self, request: Request, token: int, logprob: float, top=()) -> TokenEvent:
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        request.output.append(token)
        request.logprobs.append(logprob)
        if request.params.top_logprobs:
            request.top_logprobs.append(top)
        params = request.params
        reason = None
        if params.stop_at_eod and self.eod is not None and token == self.eod:
            reason = "stop"
        elif params.stop and self.detokenize is not None:
            text = self.detokenize(request.output)
            cut = min((text.find(s) for s in params.stop if s in text), default=-1)
            if cut >= 0:
                request.text, reason = text[:cut], "stop"
        if reason is None and len(request.output) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            request.finish_reason = reason
            self.scheduler.finish(request)
            self._to_free.append(request.rid)
        return TokenEvent(request.rid, token, logprob, reason, top)

    def shutdown(self) -> None:
        """Tell the following ranks to return from :meth:`follow`."""
        self._broadcast(None)

    def generate(self, prompts: Sequence[Sequence[int]], params) -> List[Request]:
        """Run ``prompts`` (one :class:`SamplingParams` each, or one for all) to completion
        (scheduling rank); returns their finished requests in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        rids = [self.add_request(p, s) for p, s in zip(prompts, params)]
        while any(self.requests[r].finish_reason is None for r in rids):
            self.step()
        return [self.requests[r] for r in rids]

    # -- every rank ------------------------------------------------------------------------
    def follow(self) -> bool:
        """Run the scheduling rank's next step; False once it shut down (other ranks)."""
        plan = self._broadcast(None, receive=True)
        if plan is None:
            return False
        self._execute(plan)
        return True

    def score(self, sequences: Sequence[Sequence[int]], counts: Sequence[int]) -> List[tuple]:
        """Log-likelihood of the last ``counts[i]`` tokens of ``sequences[i]`` given the tokens
        before them (scheduling rank; the other ranks run it from :meth:`follow`).

        One forward per sequence over ``sequence[:-1]`` without cache (no other request in it).
        Returns ``[(sum of the log-probabilities (float, fp32 log-softmax over the true
        vocabulary), every scored token is the arg-max (bool))]``.

        Raises:
            ValueError: a count outside ``[1, len(sequence) - 1]``, a sequence longer than
                ``max_position_embeddings`` + 1 or with ids outside the vocabulary.
        """
        limit = self.model.config.max_position_embeddings
        jobs = []
        for seq, n in zip(sequences, counts):
            seq = [int(t) for t in seq]
            if not 1 <= n < len(seq):
                raise ValueError(f"score: {n} tokens to score of a sequence of {len(seq)}")
            if len(seq) - 1 > limit:
                raise ValueError(f"score: a sequence of {len(seq)} tokens exceeds the model's "
                                 f"context of {limit} positions (+1)")
            if min(seq) < 0 or max(seq) >= self.vocab_size:
                raise ValueError(f"score: token ids must be in [0, {self.vocab_size})")
            jobs.append((seq, int(n)))
        plan = {"free": self._to_free, "entries": [], "score": jobs}
        self._to_free = []
        self._broadcast(plan)
        return self._execute(plan)

    def _score(self, jobs) -> List[tuple]:
        out = torch.zeros(len(jobs), 2, dtype=torch.float64, device=self.device)
        for i, (seq, n) in enumerate(jobs):
            tokens = torch.tensor([seq[:-1]], dtype=torch.long, device=self.device)
            logits = forward_logits(self.model, tokens, pg_collection=self.groups)
            if logits is None:
                continue
            lp = torch.log_softmax(logits[0, -n:, :self.vocab_size].float(), dim=-1)
            target = torch.tensor(seq[-n:], dtype=torch.long, device=lp.device)
            out[i, 0] = lp.gather(-1, target[:, None]).sum().double()
            out[i, 1] = float(bool((lp.argmax(-1) == target).all()))
        out = _share_from_last_stage(out, self.groups)
        return [(float(s), bool(g)) for s, g in out.tolist()]

    def _broadcast(self, plan, receive: bool = False):
        if self.groups.dp.size > 1:  # expert-parallel ranks: every rank of the world follows
            box = [plan]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        model = self.groups.model
        if model.size <= 1:
            return plan
        box = [plan]
        dist.broadcast_object_list(box, src=model.ranks[0], group=model.group)
        return box[0]

    def _execute(self, plan) -> List[tuple]:
        """Run the plan's forwards; returns ``[(token, logprob, top)]`` of its sampling entries
        (``top``: ``((id, logprob), ...)``, the entry's ``top_logprobs`` most likely tokens)."""
        for rid in plan["free"]:
            self._generators.pop(rid, None)
        if "score" in plan:
            return self._score(plan["score"])
        entries: List[PlanEntry] = plan["entries"]
        if not entries:
            return []
        groups = [entries] if self.packed else [[e] for e in entries]
        rows = []  # last-row logits [v] of each sampling entry, in order
        for group in groups:
            logits = self._forward(group)
            offset = 0
            for entry in group:
                offset += len(entry.tokens)
                if entry.sample is not None and logits is not None:
                    rows.append(logits[0, offset - 1])
        samplers = [e for e in entries if e.sample is not None]
        # Every rank knows the plan, so the shared tensor's width agrees without a message:
        # token, its log-probability, then (id, log-probability) pairs of the widest request.
        width = max((e.sample.top_logprobs for e in samplers), default=0)
        out = torch.zeros(len(samplers), 2 + 2 * width, dtype=torch.float64, device=self.device)
        for i, (entry, row) in enumerate(zip(samplers, rows)):
            p = entry.sample
            if entry.rid not in self._generators:
                self._generators[entry.rid] = torch.Generator(device=row.device).manual_seed(p.seed)
            token = sample(row[None], greedy=p.greedy, temperature=p.temperature, top_k=p.top_k,
                           top_p=p.top_p, vocab_size=self.vocab_size,
                           generator=self._generators[entry.rid])
            logprobs = torch.log_softmax(row[:self.vocab_size].float(), dim=-1)
            out[i, 0], out[i, 1] = token.double(), logprobs[token].double()
            if p.top_logprobs:
                values, ids = logprobs.topk(min(p.top_logprobs, self.vocab_size))
                n = ids.numel()
                out[i, 2:2 + 2 * n:2], out[i, 3:3 + 2 * n:2] = ids.double(), values.double()
        out = _share_from_last_stage(out, self.groups)
        result = []
        for entry, values in zip(samplers, out.tolist()):
            n = min(entry.sample.top_logprobs, self.vocab_size)
            top = tuple((int(values[2 + 2 * j]), float(values[3 + 2 * j])) for j in range(n))
            result.append((int(values[0]), float(values[1]), top))
        return result

    def _forward(self, group: List[PlanEntry]):
        segments, offset = [], 0
        for entry in group:
            segments.append(Segment(offset, len(entry.tokens), entry.position, entry.blocks))
            offset += len(entry.tokens)
        tokens = torch.tensor([[t for e in group for t in e.tokens]], dtype=torch.long,
                              device=self.device)
        positions = torch.tensor([[e.position + i for e in group for i in range(len(e.tokens))]],
                                 dtype=torch.long, device=self.device)
        return forward_logits(self.model, tokens, positions, PagedStep(self.cache, segments),
                              pg_collection=self.groups)
