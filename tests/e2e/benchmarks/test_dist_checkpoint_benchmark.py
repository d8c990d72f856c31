"""benchmarks/dist_checkpoint.py runs (tiny model) and gives every row run_all prints: the disk,
each format's save and load with its share of the disk's speed, the async stall ratio."""

from tests.helpers.dist import run_distributed


def _quick():
    from benchmarks.dist_checkpoint import run
    return run(quick=True)


def test_quick_run_gives_every_row():
    rows = run_distributed(1, _quick, timeout=300)[0]
    cases = [r["case"] for r in rows]
    assert cases == ["disk sequential write", "--ckpt-format torch save",
                     "--ckpt-format torch_dist save", "--ckpt-format torch load",
                     "--ckpt-format torch_dist load", "torch_dist save stall, sync",
                     "torch_dist save stall, --async-save", "steps during the async write"]
    assert all(r["GB/s"] > 0 and r["of ceiling"] > 0 for r in rows[1:5])
    sync, asynchronous = rows[5], rows[6]
    assert rows[7]["ratio"] > 0 and "forward-backward passes" in rows[7]["note"]
    assert asynchronous["ratio"] == asynchronous["seconds"] / sync["seconds"]
    assert "0.00 B parameters, weights + Adam" in rows[0]["note"]
