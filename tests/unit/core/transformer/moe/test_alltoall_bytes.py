"""The all-to-all bytes benchmarks/moe.py measures per iteration and rank equal the planner's
formula (:func:`megatron.planner.moe.alltoall_bytes_per_iteration`, ``4 T k h e (EP-1)/EP`` per
MoE layer) when the routing is the uniform one the formula assumes: a stack of 3 MoE layers,
2 micro-batches, at EP=2 (4 experts) and EP=4 (8 experts), counted at the dispatcher's
``all_to_all_single``."""

import pytest

from tests.helpers.dist import run_distributed

SHAPES = {2: dict(hidden=16, ffn=8, experts=4, topk=2, layers=3, tokens=24, microbatches=2),
          4: dict(hidden=8, ffn=8, experts=8, topk=2, layers=3, tokens=32, microbatches=2)}


def _measure(p):
    from benchmarks.moe import measure_alltoall

    return measure_alltoall(p, balanced=True)


@pytest.mark.parametrize("ep", [2, 4])
def test_measured_alltoall_bytes_equal_the_planner(ep):
    from megatron.planner.moe import alltoall_bytes_per_iteration

    p = SHAPES[ep]
    want = alltoall_bytes_per_iteration(p["tokens"] * p["microbatches"], p["topk"], p["hidden"],
                                        4, ep=ep, moe_layers_per_rank=p["layers"])
    sent = run_distributed(ep, _measure, p)
    assert want > 0
    assert sent == [want] * ep
