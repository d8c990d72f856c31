"""The context-parallel attentions against unsplit causal attention in one process: forward
output and the gradients of q, k and v, fp32, grouped-query and multi-head, ring (``p2p``) and
all-gather, CP = 2 and 4 (each world runs every case; the CP = 2 world again with the tiled
implementation of non-CPU devices); in bf16 the split attention is as close to the fp32 result
as unsplit bf16 attention is; document masks (packed sequences whose documents cross the chunk
boundaries) against unsplit SDPA with the dense mask."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.context_parallel import block_attention
from megatron.core.context_parallel.attention import context_parallel_attention
from megatron.core.context_parallel.split import split_for_context_parallel
from tests.helpers.dist import run_distributed

# (b, n, g, s, d): grouped-query (2 query heads per group) and multi-head.
CASES = [(2, 4, 2, 16, 8), (1, 2, 2, 24, 4)]


def _full(case, seed):
    b, n, g, s, d = case
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, n, s, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, g, s, d, generator=gen) for _ in range(2))
    return q, k, v, dout


def _reference(q, k, v, dout):
    """Unsplit causal attention (the kernel the model runs at CP = 1) and its gradients."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True,
                                         enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _split_run(q, k, v, dout, comm_type, group, cp, rank):
    local = [split_for_context_parallel(t, cp, rank, seq_dim=2).requires_grad_()
             for t in (q, k, v)]
    out = context_parallel_attention(*local, group=group, comm_type=comm_type)
    out.backward(split_for_context_parallel(dout, cp, rank, seq_dim=2))
    return [out.detach()] + [t.grad for t in local]


def _world(tiled_too: bool):
    worst = _compare_all()
    if tiled_too:  # again with the implementation every non-CPU device runs
        block_attention._use_cpu_kernel = lambda q: False
        worst.update({f"tiled {k}": v for k, v in _compare_all().items()})
    return worst


def _compare_all():
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    worst = {}
    for i, case in enumerate(CASES):
        q, k, v, dout = _full(case, seed=i)
        expected = [split_for_context_parallel(t, cp, rank, seq_dim=2)
                    for t in _reference(q, k, v, dout)]
        for comm_type in ("p2p", "all_gather"):
            got = _split_run(q, k, v, dout, comm_type, group, cp, rank)
            for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected):
                # Exact up to fp32 rounding of a different summation order.
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6,
                                           msg=f"{comm_type} {case} {name} rank {rank}")
                key = f"{comm_type} {name}"
                worst[key] = max(worst.get(key, 0.0), (a - e).abs().max().item())
    _compare_documents(group, cp, rank, worst)
    _compare_bf16(group, cp, rank)
    return worst


def _document_ids(b, s, seed):
    """Rows of different documents that cross the chunk boundaries of the split (ends drawn at
    random, one row a single document, one a document of one token)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(b, s, dtype=torch.long)
    for r in range(1, b):
        ends = torch.randperm(s - 1, generator=gen)[:3] + 1
        ids[r] = (torch.arange(s)[:, None] >= ends[None, :]).sum(1)
    if b > 1:
        ids[-1, 1:] += 1  # a first document of one token
    return ids


def _compare_documents(group, cp, rank, worst):
    """Document masks over the split against unsplit SDPA with Megatron-LM's dense mask."""
    for i, case in enumerate(CASES):
        b, n, g, s, d = case
        ids = _document_ids(b + 1, s, seed=10 + i)
        q, k, v, dout = (torch.cat([t, t[:1]]) for t in _full(case, seed=10 + i))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        allowed = torch.tril(torch.ones(s, s, dtype=torch.bool)) & (ids[:, :, None] == ids[:, None])
        out = F.scaled_dot_product_attention(*leaves, attn_mask=allowed[:, None],
                                             enable_gqa=n != g)
        out.backward(dout)
        expected = [split_for_context_parallel(t, cp, rank, seq_dim=2)
                    for t in [out.detach()] + [t.grad for t in leaves]]
        for comm_type in ("p2p", "all_gather"):
            local = [split_for_context_parallel(t, cp, rank, seq_dim=2).requires_grad_()
                     for t in (q, k, v)]
            got = context_parallel_attention(*local, group=group, comm_type=comm_type,
                                             document_ids=ids)
            got.backward(split_for_context_parallel(dout, cp, rank, seq_dim=2))
            for name, a, e in zip(("out", "dq", "dk", "dv"), [got.detach()] +
                                  [t.grad for t in local], expected):
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6,
                                           msg=f"documents {comm_type} {case} {name} rank {rank}")
                key = f"documents {comm_type} {name}"
                worst[key] = max(worst.get(key, 0.0), (a - e).abs().max().item())


def _compare_bf16(group, cp, rank):
    """bf16 inputs: the split result is as close to fp32 attention of the same (rounded) inputs
    as the unsplit bf16 attention is, plus the roundings the split adds: the kernel rounds each
    of the (at most CP) block results to bf16 before the fp32 merge, and the sum is rounded once
    more; each rounding is at most half a unit in the last place (ulp) of the largest value."""
    full = [t.bfloat16() for t in _full(CASES[0], seed=5)]
    exact = [split_for_context_parallel(t, cp, rank, seq_dim=2)
             for t in _reference(*(t.float() for t in full))]
    unsplit = [split_for_context_parallel(t, cp, rank, seq_dim=2).float()
               for t in _reference(*full)]
    for comm_type in ("p2p", "all_gather"):
        got = _split_run(*full, comm_type, group, cp, rank)
        for name, a, e, u in zip(("out", "dq", "dk", "dv"), got, exact, unsplit):
            assert a.dtype == torch.bfloat16
            error = (a.float() - e).abs().max().item()
            ulp = 2.0 ** (math.floor(math.log2(e.abs().max().item())) - 7)
            budget = (u - e).abs().max().item() + (cp + 1) / 2 * ulp
            assert error <= budget, (comm_type, name, error, budget)


@pytest.mark.parametrize("cp", [2, 4])
def test_split_attention_equals_unsplit(cp):
    worst = run_distributed(cp, _world, cp == 2)
    # Every rank compared its rows; the errors are rounding, not zero by construction.
    assert all(0.0 < max(w.values()) < 1e-5 for w in worst)
    assert all(any(key.startswith("documents") for key in w) for w in worst)
    assert any(key.startswith("tiled") for key in worst[0]) == (cp == 2)


def test_unknown_comm_type_refused():
    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="--cp-comm-type 'a2a' is not one of p2p, all_gather"):
        context_parallel_attention(q, q, q, group=None, comm_type="a2a")
