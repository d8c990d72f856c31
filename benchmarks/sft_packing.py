"""Packing efficiency of SFTDataset's packer on a generated set of conversation lengths.

Lengths: log-normal (median 300 tokens, sigma 0.9), clipped to [2, seq_length + 1], the shape of
chat SFT sets. Efficiency = token positions / (sequences * seq_length); one line per packer.
Run: ``python benchmarks/sft_packing.py [--n 20000] [--seq-length 2048]``.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.data.sft_dataset import pack_first_fit, packing_efficiency  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = np.random.RandomState(a.seed)
    lengths = np.clip(rng.lognormal(np.log(300), 0.9, a.n).astype(np.int64), 2, a.seq_length + 1) - 1
    print(f"{a.n} conversations, seq_length {a.seq_length}, mean {lengths.mean():.0f} positions")
    print(f"{'packer':<34}{'sequences':>10}{'efficiency':>12}{'seconds':>9}")
    print(f"{'one per sequence (unpacked)':<34}{a.n:>10}{lengths.sum() / (a.n * a.seq_length):>12.4f}{0:>9.2f}")
    for name, window in (("first-fit (window 1)", 1), ("FFD, window 100", 100), ("FFD, window 1000", 1000),
                         ("FFD, whole set", a.n)):
        t = time.time()
        bins = pack_first_fit(lengths, a.seq_length, window)
        print(f"{name:<34}{len(bins):>10}{packing_efficiency(lengths, bins, a.seq_length):>12.4f}"
              f"{time.time() - t:>9.2f}")


if __name__ == "__main__":
    main()
