"""Autoregressive text generation with a KV cache, at any tensor/pipeline-parallel layout
(Megatron-LM's ``generate_tokens_probs_and_return_on_first_stage``, without the probabilities).

Shapes: b = prompts, L = longest prompt + ``tokens_to_generate``, v = vocabulary.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.inference.forward import forward_logits
from megatron.inference.inference_params import InferenceParams


def sample(logits: torch.Tensor, *, greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 0.0, vocab_size: Optional[int] = None,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next tokens ``[b]`` (int64) from ``logits [b, v]``.

    Greedy takes the arg-max; otherwise logits are divided by ``temperature``, restricted to the
    ``top_k`` largest and/or the smallest set whose probability reaches ``top_p`` (nucleus
    sampling, Holtzman et al. 2019), and sampled. Ids ``>= vocab_size`` (vocabulary padding) are
    never chosen.

    Raises:
        ValueError: temperature <= 0, top_k < 0, or top_p outside [0, 1].
    """
    if temperature <= 0:
        raise ValueError(f"--temperature must be > 0 (got {temperature}); use --greedy for arg-max")
    if top_k < 0 or not 0.0 <= top_p <= 1.0:
        raise ValueError(f"--top-k must be >= 0 and --top-p in [0, 1] (got {top_k}, {top_p})")
    logits = logits.float().clone()
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits[:, vocab_size:] = float("-inf")
    if greedy:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # keep the token crossing top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _share_from_last_stage(tokens: torch.Tensor, pg_collection) -> torch.Tensor:
    """Tensor-parallel rank 0 of the last stage decides; every rank of the model-parallel group
    receives its value (broadcast over the tensor-parallel group, then the pipeline group)."""
    tp, pp = pg_collection.tp, pg_collection.pp
    if pg_collection.is_pipeline_last_stage() and tp.size > 1:
        dist.broadcast(tokens, tp.ranks[0], group=tp.group)
    if pp.size > 1:
        dist.broadcast(tokens, pp.ranks[-1], group=pp.group)
    return tokens


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], tokens_to_generate: int, *,
             greedy: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0,
             vocab_size: Optional[int] = None, eod: Optional[int] = None, seed: int = 1234,
             device=None, pg_collection) -> List[List[int]]:
    """Continue each prompt by up to ``tokens_to_generate`` tokens. Collective over the
    model-parallel group: every rank calls it with the same prompts.

    Prompts of different lengths are handled as in Megatron-LM: decoding starts after the shortest
    prompt and a longer prompt's own tokens are kept where it still has them. A sequence stops
    after ``eod``.

    Args:
        model: one pipeline stage (``LlamaModel``), in eval mode.
        prompts: token ids per prompt (non-empty).
        vocab_size: the true vocabulary size (padding ids are never sampled); default the
            model's (``model.config.true_vocab_size``: a checkpoint's, as its args record it).
        seed: seed of the sampling generator.
        pg_collection: this rank's process groups
            (:class:`~megatron.core.process_groups.ProcessGroupCollection`; ``world_of_one()`` in
            a single process).

    Returns:
        per prompt, its tokens followed by the generated ones (ending at ``eod`` if produced).

    Raises:
        ValueError: an empty prompt, or prompt + generation longer than the model's
            ``max_position_embeddings``.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lengths = [len(p) for p in prompts]
    total = max(lengths) + tokens_to_generate
    if total > model.config.max_position_embeddings:
        raise ValueError(f"prompt ({max(lengths)}) + tokens to generate ({tokens_to_generate}) "
                         f"exceeds --max-position-embeddings ({model.config.max_position_embeddings})")
    if vocab_size is None:
        vocab_size = model.config.true_vocab_size
    b = len(prompts)
    tokens = torch.zeros(b, total, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    length_t = torch.tensor(lengths, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    ended_at = torch.full((b,), total, dtype=torch.long, device=device)
    params = InferenceParams(b, total)
    generator = torch.Generator(device=tokens.device).manual_seed(seed)
    prev = 0
    for cur in range(min(lengths), total):
        chunk = tokens[:, prev:cur]
        positions = torch.arange(prev, cur, device=tokens.device).unsqueeze(0).expand(b, -1)
        logits = forward_logits(model, chunk, positions, params, pg_collection=pg_collection)
        params.sequence_len_offset += cur - prev
        new = torch.zeros(b, dtype=torch.long, device=tokens.device)
        if logits is not None:
            new = sample(logits[:, -1], greedy=greedy, temperature=temperature, top_k=top_k,
                         top_p=top_p, vocab_size=vocab_size, generator=generator)
        new = _share_from_last_stage(new, pg_collection)
        generating = cur >= length_t
        tokens[:, cur] = torch.where(generating, new, tokens[:, cur])
        if eod is not None:
            finished = generating & (new == eod) & ~done
            ended_at = torch.where(finished, torch.full_like(ended_at, cur + 1), ended_at)
            done |= finished
            if bool(done.all()):
                break
        prev = cur
    return [tokens[i, :int(ended_at[i])].tolist() if bool(done[i]) else tokens[i].tolist()
            for i in range(b)]
