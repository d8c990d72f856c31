"""The context-parallel attentions against unsplit causal attention in one process: forward
output and the gradients of q, k and v, fp32, grouped-query and multi-head, ring (``p2p``) and
all-gather, CP = 2 and 4 (each world runs every case)."""

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


def _world(tiled: bool):
    if tiled:  # the implementation every non-CPU device runs
        block_attention._use_cpu_kernel = lambda q: False
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
    return worst


@pytest.mark.parametrize("cp", [2, 4])
def test_split_attention_equals_unsplit(cp):
    worst = run_distributed(cp, _world, False)
    # Every rank compared its rows; the errors are rounding, not zero by construction.
    assert all(0.0 < max(w.values()) < 1e-5 for w in worst)


def test_tiled_implementation_equals_unsplit():
    worst = run_distributed(2, _world, True)
    assert all(max(w.values()) < 1e-5 for w in worst)


def test_unknown_comm_type_refused():
    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match="--cp-comm-type 'a2a' is not one of p2p, all_gather"):
        context_parallel_attention(q, q, q, group=None, comm_type="a2a")
