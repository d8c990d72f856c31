"""benchmarks/moe.py --quick gives every row run_all prints: at EP=2 with the balanced router
each rank's all-to-all bytes per iteration equal the planner's formula, with the router at
initialisation they are the bytes the routing sent (both ranks the same total: each sends its
own remote choices and returns the other's); every time positive, each ratio against its row's
reference."""

import pytest


@pytest.mark.slow
def test_quick_run_gives_every_row():
    from benchmarks.moe import QUICK, run
    from benchmarks.run_all import format_table
    from megatron.planner.moe import alltoall_bytes_per_iteration

    rows = run(quick=True)
    by_case = {r["case"]: r for r in rows}
    want = alltoall_bytes_per_iteration(QUICK["tokens"] * QUICK["microbatches"], QUICK["topk"],
                                        QUICK["hidden"], 4, ep=2,
                                        moe_layers_per_rank=QUICK["layers"])
    for rank in (0, 1):
        balanced = by_case[f"a2a bytes/iter EP=2 rank {rank}, balanced router"]
        assert balanced["measured"] == balanced["theory"] == want
    assert by_case["a2a bytes/iter EP=2 rank 0, router at init"]["measured"] == \
        by_case["a2a bytes/iter EP=2 rank 1, router at init"]["measured"] > 0
    timed = [r for r in rows if "ms/step" in r]
    assert len(timed) == 6 and all(r["ms/step"] > 0 and r["ratio"] > 0 for r in timed)
    assert all(r["benchmark"] == "moe" for r in rows)
    assert "a2a bytes/iter" in format_table(rows)
