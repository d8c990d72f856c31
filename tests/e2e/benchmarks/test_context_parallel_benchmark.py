"""benchmarks/context_parallel.py --quick (1024 tokens) runs at CP = 1, 2, 4 with both comm types
and gives the rows run_all prints; the saved activation bytes per rank are 1/CP of one process's
(to rounding of the few per-rank scalars), the peak and CPU time below one process's."""

import pytest


@pytest.mark.slow
def test_quick_run_gives_every_row():
    from benchmarks.context_parallel import run
    from benchmarks.run_all import format_table

    rows = run(quick=True)
    assert [r["case"] for r in rows] == ["s1024 CP=1", "s1024 CP=2 p2p", "s1024 CP=2 all_gather",
                                         "s1024 CP=4 p2p", "s1024 CP=4 all_gather"]
    assert rows[0]["saved MB ratio"] == 1.0 and rows[0]["saved MB"] > 0
    for r in rows[1:]:
        cp = int(r["case"].split("CP=")[1].split()[0])
        assert r["saved MB ratio"] == pytest.approx(1 / cp, rel=0.02), r
        assert 0 < r["peak MB ratio"] < 1 and 0 < r["cpu ms/step ratio"] < 1, r
    table = format_table(rows)
    assert "saved MB ratio" in table and "s1024 CP=4 all_gather" in table
