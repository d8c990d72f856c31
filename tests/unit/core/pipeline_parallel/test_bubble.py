"""The pipeline bubble computed from the operation order our schedules record equals the theory
exactly: ``(p - 1) / (m + p - 1)`` for 1F1B and ``((p - 1) / v) / (m + (p - 1) / v)`` for the
interleaved schedule (Narayanan et al. 2021, section 2.2), at PP=2 and 4 and several micro-batch
counts, for backward/forward time ratios 2 and 1. The replay itself is checked on orders that are
not 1F1B (no pipelining at all: a larger bubble; a deadlock: an error)."""

from fractions import Fraction

import pytest

from benchmarks.pipeline import _world, bubble_from_order, theory
from tests.helpers.dist import run_distributed


@pytest.mark.parametrize("pp, ms", [(2, [1, 2, 3, 4, 6]), (4, [3, 4, 8, 12])])
def test_recorded_schedule_bubble_equals_theory(pp, ms):
    cases = [(1, m) for m in ms] + [(2, m) for m in ms if m % pp == 0]
    per_rank = run_distributed(pp, _world, pp, cases, 0.0, 0.0, 1, timeout=300)
    for k, (v, m) in enumerate(cases):
        orders = [r[k]["order"] for r in per_rank]
        assert all(len(o) == 2 * m * v for o in orders), (v, m)
        for tf, tb in ((1, 2), (1, 1)):
            got = bubble_from_order(orders, pp, v, Fraction(tf), Fraction(tb))
            assert got == theory(pp, m, v), (pp, v, m, tf, tb, got)
    # Interleaving shrinks the bubble time (p - 1)(tf + tb) by 1 / v.
    assert theory(4, 8, 2) == Fraction(3, 2) / (8 + Fraction(3, 2))


def test_replay_tells_other_orders_apart():
    pp, m = 2, 4
    # No overlap at all: each stage runs F then B of one micro-batch before the next.
    serial = [[("F", 0), ("B", 0)] * m for _ in range(pp)]
    assert bubble_from_order(serial, pp, 1) > theory(pp, m)
    # Stage 0 waits for a backward before running the forward stage 1 needs for it.
    with pytest.raises(ValueError, match="deadlock"):
        bubble_from_order([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]], pp, 1)
