"""The paged KV cache's chunked attention (Llama 4's RoPE layers, ``--attention-chunk-size``)
against the contiguous cache's rule as a dense mask (``chunked_cache_mask``, itself checked
against transformers in tests/e2e/tools/test_convert_llama4.py): requests of several lengths in
one step, block tables out of order, blocks that do not divide the chunk; and only the chunk's
keys are gathered (no key span, hence no mask, wider than the chunk)."""

import pytest
import torch

import megatron.inference.engine.paged_kv_cache as paged
from megatron.inference.engine.paged_kv_cache import PagedKVCache, PagedStep, Segment
from megatron.model.attention_mask import AttentionMask, masked_attention
from megatron.model.chunked_attention import chunked_cache_mask

N, G, D = 4, 2, 8


def _reference(q, k, v, chunk):
    """Whole-history attention of one request ``[L, n, d]`` with the dense cache mask."""
    mask = chunked_cache_mask(0, q.shape[0], chunk, q.device)
    out = masked_attention(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None],
                           v.permute(1, 0, 2)[None], AttentionMask.from_dense(mask))
    return out[0].permute(1, 0, 2)


@pytest.mark.parametrize("chunk", [None, 4, 5])
def test_paged_steps_equal_the_dense_chunked_mask(chunk, monkeypatch):
    block, lengths = 3, [11, 6, 14]
    gen = torch.Generator().manual_seed(0)
    seqs = [tuple(torch.randn(L, n, D, generator=gen) for n in (N, G, G)) for L in lengths]
    cache = PagedKVCache(num_blocks=20, block_size=block)
    tables = [(7, 2, 9, 0), (1, 4), (19, 3, 8, 11, 5)]  # out of order, disjoint
    spans = []
    real = paged.masked_attention

    def recording(q, k, v, mask, *a):
        spans.append(k.shape[2])
        return real(q, k, v, mask, *a)

    monkeypatch.setattr(paged, "masked_attention", recording)
    done = [0] * len(lengths)
    got = [[] for _ in lengths]
    # Steps of 5 prefill tokens, then single tokens, the requests side by side in each step.
    while any(d < L for d, L in zip(done, lengths)):
        segments, parts, offset = [], [], 0
        for i, ((q, k, v), L) in enumerate(zip(seqs, lengths)):
            take = min(5 if done[i] < 8 else 1, L - done[i])
            if take == 0:
                continue
            segments.append(Segment(offset, take, done[i], tables[i]))
            parts.append((i, take))
            offset += take
        cat = [torch.cat([seqs[i][j][done[i]:done[i] + t] for i, t in parts])[:, None]
               for j in range(3)]
        out = PagedStep(cache, segments).attend(1, *cat, chunk_size=chunk)
        row = 0
        for i, t in parts:
            got[i].append(out[row:row + t, 0])
            row += t
            done[i] += t
    for (q, k, v), pieces in zip(seqs, got):
        torch.testing.assert_close(torch.cat(pieces), _reference(q, k, v, chunk),
                                   rtol=0, atol=1e-6)
    if chunk is None:
        assert max(spans) == max(lengths)
    else:  # every gathered key span lies within one chunk
        assert max(spans) == chunk
