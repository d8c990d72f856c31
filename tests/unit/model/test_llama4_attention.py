"""Llama 4's attention (megatron.model.chunked_attention) against independent references.

- Chunked attention (forward and q/k/v gradients) equals SDPA under a dense mask built here
  element by element from the rule (causal, same document, same chunk counted from the
  document's start), for sequence lengths that are and are not multiples of the chunk size,
  with and without packed documents; the fast path never forms an ``[s, s]`` tensor.
- A Llama 4 model (NoPE layer with temperature tuning, chunked RoPE layer with the q/k L2 norm,
  interleaved RoPE): a packed row gives each document's losses and gradients run alone;
  CP = 2 and CP = 4 (chunk boundaries inside and across the split) give the losses and
  gradients of one process, with and without documents, fp32 rtol 1e-6.
- ``--no-rope-freq`` follows Megatron-Core's rule (every N-th layer counted from 1), and the
  generation step's chunked mask equals the rule.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.model.attention_mask import AttentionMask
from megatron.model.chunked_attention import (chunk_document_ids, chunked_attention,
                                              chunked_cache_mask, no_rope_pattern)
from megatron.model.llama import LlamaModel
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.model import small_config
from tests.unit.model.test_attention_mask import (EODS, S, _assert_same, _loss_and_grads,
                                                  _NoSquareTensors, _packed, _weights,
                                                  packed_and_alone)

CHUNK = 5
# The documents of the packed row (test_attention_mask's row 0: EOD at 5, 13, 27)
PACKED_DOCUMENTS = list(zip([0] + [e + 1 for e in EODS[0]], [e + 1 for e in EODS[0]] + [S]))


def llama4_config(**changes):
    """Layer 1 a chunked RoPE layer with the q/k L2 norm, layer 2 a NoPE layer whose queries are
    temperature-scaled (floor scale 4: the scale changes every 4 positions)."""
    return small_config(rotary_interleaved=True, qk_l2_norm=True, no_rope_freq=(0, 1),
                        attention_chunk_size=CHUNK, attn_temperature_tuning=True,
                        attn_temperature_floor_scale=4.0, attn_temperature_scale=0.5, **changes)


def _rule_mask(document_ids, chunk):
    """bool ``[b, 1, s, s]``, True = masked, element by element from the rule."""
    b, s = document_ids.shape
    masked = torch.ones(b, 1, s, s, dtype=torch.bool)
    for r in range(b):
        ids = document_ids[r].tolist()
        start = [ids.index(i) for i in ids]  # each token's document start
        for i in range(s):
            for j in range(i + 1):
                same_doc = ids[i] == ids[j]
                same_chunk = (i - start[i]) // chunk == (j - start[j]) // chunk
                masked[r, 0, i, j] = not (same_doc and same_chunk)
    return masked


def _attention_and_grads(fn, q, k, v, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("s", [8, 11, 12, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_attention_equals_the_rule_as_a_dense_mask(s, packed):
    gen = torch.Generator().manual_seed(s)
    b, n, g, d, chunk = 2, 4, 2, 16, 4
    q, dout = (torch.randn(b, n, s, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, g, s, d, generator=gen) for _ in range(2))
    if packed:  # documents of 6 and s - 6 tokens, and of 2, 1 and the rest
        ids = torch.tensor([[0] * min(6, s) + [1] * (s - min(6, s)),
                            ([0, 0, 1] + [2] * s)[:s]])
        mask = AttentionMask.from_document_ids(ids)
    else:
        ids, mask = torch.zeros(b, s, dtype=torch.long), None
    dense = ~_rule_mask(ids, chunk)
    expected = _attention_and_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True),
        q, k, v, dout)
    with _NoSquareTensors(s) as spy:
        got = _attention_and_grads(lambda q, k, v: chunked_attention(q, k, v, mask, chunk),
                                   q, k, v, dout)
    assert spy.found == [] or s <= chunk  # one chunk: plain causal SDPA
    for a, e, what in zip(got, expected, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


def test_chunk_ids_restart_at_documents():
    ids = chunk_document_ids(torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2]]), 2, 1, 9)
    assert ids.tolist() == [[0, 0, 1, 1, 2, 3, 3, 4, 5]]
    assert chunk_document_ids(None, 3, 2, 7).tolist() == [[0, 0, 0, 1, 1, 1, 2]] * 2


def test_generation_mask_is_the_rule():
    got = chunked_cache_mask(5, 3, 4, "cpu")[0, 0]
    rule = _rule_mask(torch.zeros(1, 8, dtype=torch.long), 4)[0, 0, 5:]
    assert torch.equal(got, rule)
    assert torch.equal(chunked_cache_mask(5, 3, None, "cpu")[0, 0],
                       torch.arange(8)[None, :] > torch.arange(5, 8)[:, None])


def test_no_rope_freq_follows_megatron_core():
    assert no_rope_pattern(4, 8) == (0, 0, 0, 1, 0, 0, 0, 1)
    assert no_rope_pattern([1, 0], 2) == (1, 0)
    with pytest.raises(ValueError, match="--no-rope-freq"):
        no_rope_pattern([1, 0], 3)


def test_packed_documents_equal_each_document_alone():
    """Chunks restart at each document and NoPE temperatures follow the reset positions."""
    packed, alone = packed_and_alone(llama4_config(), spy_length=S)
    assert max(e - a for a, e in PACKED_DOCUMENTS) > CHUNK  # chunks inside a document
    _assert_same(packed, alone, "packed vs alone")


def _cp_rank(config, cp, with_documents):
    from megatron.core import parallel_state
    from megatron.core.context_parallel import get_batch_on_this_cp_rank, split_for_context_parallel
    groups = parallel_state.initialize_model_parallel(1, 1, context_parallel_size=cp)
    model = LlamaModel(config.replace(context_parallel_size=cp), pg_collection=groups)
    tokens, labels, positions, mask = _packed(config)
    if not with_documents:
        positions, mask = torch.arange(S).expand(2, S), None
    full = {"tokens": tokens, "labels": labels, "position_ids": positions, "attention_mask": mask}
    mine = get_batch_on_this_cp_rank(full, cp, groups.cp.rank)
    weights = split_for_context_parallel(_weights(tokens.shape), cp, groups.cp.rank)
    loss, grads = _loss_and_grads(model, mine["tokens"], mine["position_ids"],
                                  mine["attention_mask"], mine["labels"], weights)
    for g in grads.values():  # the gradient of the whole sequence's weighted loss
        dist.all_reduce(g, group=groups.cp.group)
    return loss, grads


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("with_documents", [False, True])
def test_context_parallel_equals_one_process(cp, with_documents):
    """S = 32 split in 2 CP pieces of 32 / (2 CP) tokens: chunks of 5 cross the pieces."""
    from megatron.core.context_parallel import split_for_context_parallel
    config = llama4_config()
    single = LlamaModel(config, pg_collection=current_groups())
    tokens, labels, positions, mask = _packed(config)
    if not with_documents:
        positions, mask = None, None
    expected = _loss_and_grads(single, tokens, positions, mask, labels)
    for rank, got in enumerate(run_distributed(cp, _cp_rank, config, cp, with_documents)):
        _assert_same(got, (split_for_context_parallel(expected[0], cp, rank), expected[1]),
                     f"CP={cp} rank {rank}")
