"""Sampling parameters of one request (OpenAI's completion parameters, vLLM's ``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

# The most alternatives per position a request may ask for (OpenAI's bound for chat's
# ``top_logprobs``; each costs 16 bytes per token in the step's broadcast).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request is continued.

    Attributes:
        max_tokens: tokens to generate at most (>= 1).
        greedy: arg-max decoding (``temperature == 0`` in the OpenAI API means this).
        temperature: > 0; logits are divided by it before sampling.
        top_k: keep the k most likely tokens (0: all).
        top_p: nucleus sampling threshold in [0, 1] (0 or 1: off).
        seed: seed of this request's own ``torch.Generator``: its draws never depend on other
            requests of the batch.
        stop: strings that end the generation; the text is cut before the first one.
        stop_at_eod: end at the tokenizer's end-of-document id.
        top_logprobs: also return, per generated token, the ids and log-probabilities of the
            ``top_logprobs`` most likely tokens at that position (fp32 log-softmax over the true
            vocabulary, most likely first; 0: none). At most :data:`MAX_TOP_LOGPROBS`.
    """

    max_tokens: int = 16
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 1234
    stop: Tuple[str, ...] = field(default_factory=tuple)
    stop_at_eod: bool = True
    top_logprobs: int = 0

    def __post_init__(self):
        errors = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            errors.append(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if not self.greedy and not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            errors.append(f"temperature must be > 0 (got {self.temperature!r}); 0 means greedy")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            errors.append(f"top_k must be an integer >= 0 (got {self.top_k!r})")
        if not isinstance(self.top_p, (int, float)) or not 0.0 <= self.top_p <= 1.0:
            errors.append(f"top_p must be in [0, 1] (got {self.top_p!r})")
        if not isinstance(self.seed, int):
            errors.append(f"seed must be an integer (got {self.seed!r})")
        if not all(isinstance(s, str) and s for s in self.stop):
            errors.append(f"stop must be non-empty strings (got {self.stop!r})")
        if (not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool)
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            errors.append(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] "
                          f"(got {self.top_logprobs!r})")
        if errors:
            raise ValueError("; ".join(errors))
