"""What the CRC check of :func:`megatron.core.dist_checkpointing.checkpoint_io.load_torch_file` costs on a checkpoint file.

A ``model_optim_rng.pt``-like file of fp32 tensors (100 MB; 8 MB with ``--quick``) is written to a
temporary folder, then loaded repeatedly with and without the check, the page cache warm (the
check reads the file once more; a cold cache would add one read of the file from disk). Each
figure is the median of the rounds; ``ratio`` = load with the check / load without.

Usage: python benchmarks/checkpoint_io.py [--quick]; ``run(quick)`` returns the rows for run_all.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from megatron.core.dist_checkpointing.checkpoint_io import (  # noqa: E402
    load_torch_file, verify_checksums)


def _median_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(quick: bool = False, rounds: int = 7) -> list:
    """Rows: load without / with the CRC check, and the check alone, in seconds."""
    megabytes = 8 if quick else 100
    tensors = 10
    numel = megabytes * 10**6 // 4 // tensors
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model_optim_rng.pt")
        torch.save({f"layer{i}.weight": torch.randn(numel) for i in range(tensors)}, path)
        size = os.path.getsize(path) / 1e6
        load_torch_file(path)  # warm the page cache
        plain = _median_seconds(lambda: load_torch_file(path, verify=False), rounds)
        checked = _median_seconds(lambda: load_torch_file(path), rounds)
        crc = _median_seconds(lambda: verify_checksums(path), rounds)
    case = f"load {size:.0f} MB"
    return [{"benchmark": "checkpoint_io", "case": f"{case}, no CRC check", "seconds": plain},
            {"benchmark": "checkpoint_io", "case": f"{case}, CRC check", "seconds": checked,
             "ratio": checked / plain},
            {"benchmark": "checkpoint_io", "case": f"CRC check alone, {size:.0f} MB", "seconds": crc}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="an 8 MB file (checks the harness)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    for r in run(args.quick, args.rounds):
        ratio = f"   ratio {r['ratio']:.3f}" if "ratio" in r else ""
        print(f"{r['case']:<32}{r['seconds'] * 1e3:10.1f} ms{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
