"""CPU layouts on 4 processes (TP=4, PP=4, DP=4, TP=2 x PP=2) against one process: tokens/s per process.

Each layout trains the same model on the same global batch with ``pretrain_llama.py`` under
``torchrun`` (gloo), on a small random-token dataset written to a temporary folder; the iteration
time is the one of the last log line (one thread per process) (the first iterations, with allocator and thread-pool
warm-up, fall in the earlier log window). The ratio column is
``(tokens/s per process of the layout) / (tokens/s of one process)``: 1.0 would be perfect
scaling; on a 2-core machine 4 processes share the cores, so the ratio mostly shows what each
layout's communication and pipeline bubble cost on top of that sharing.

Usage: python benchmarks/layouts.py [--quick]; ``run(quick)`` returns the rows for run_all.py.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

# name -> (processes, TP, PP)
LAYOUTS = {"1 process": (1, 1, 1), "TP=4": (4, 4, 1), "PP=4": (4, 1, 4), "DP=4": (4, 1, 1),
           "TP=2 x PP=2": (4, 2, 2)}
# (hidden, ffn, heads, groups, seq, vocab, global batch, iterations)
SHAPES = {False: (256, 688, 8, 4, 256, 32000, 8, 6), True: (64, 176, 8, 4, 64, 1024, 8, 4)}


def _dataset(folder: str, vocab: int) -> str:
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    prefix = os.path.join(folder, "random_text_document")
    rng = np.random.RandomState(0)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(400):
        builder.add_item(rng.randint(0, vocab - 1, size=rng.randint(64, 1024)).tolist() + [vocab - 1])
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _argv(quick: bool, data: str, cache: str, tp: int, pp: int) -> list:
    hidden, ffn, heads, groups, seq, vocab, gbs, iters = SHAPES[quick]
    return ["--num-layers", "4", "--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn),
            "--num-attention-heads", str(heads), "--group-query-attention", "--num-query-groups",
            str(groups), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "1", "--global-batch-size", str(gbs), "--train-iters", str(iters),
            "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type",
            "rope", "--swiglu", "--untie-embeddings-and-output-weights",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab - 1),
            "--make-vocab-size-divisible-by", "128", "--split", "100,0,0",
            "--log-interval", str(iters // 2), "--eval-iters", "0", "--num-workers", "0",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--data-path", data, "--data-cache-path", cache]


def _iteration_ms(out: str) -> float:
    times = re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out)
    if not times:
        raise RuntimeError("no iteration line in the output:\n" + out[-2000:])
    return float(times[-1])


def run(quick: bool = False) -> list:
    """One row per layout: tokens/s per process and the ratio to one process."""
    hidden, _, _, _, seq, vocab, gbs, _ = SHAPES[quick]
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        data = _dataset(tmp, vocab)
        for name, (procs, tp, pp) in LAYOUTS.items():
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={procs}", os.path.join(ROOT, "pretrain_llama.py")]
            # One thread per process everywhere: the baseline is one process's worth of compute,
            # and oversubscribed OpenMP pools (4 x 2 threads on 2 cores) would measure spinning.
            env = dict(os.environ, OMP_NUM_THREADS="1")
            proc = subprocess.run(cmd + _argv(quick, data, os.path.join(tmp, "cache"), tp, pp),
                                  cwd=ROOT, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                rows.append({"benchmark": "layouts", "case": name, "error": proc.stderr.strip()[-300:]})
                continue
            ms = _iteration_ms(proc.stdout)
            per_process = gbs * seq / (ms / 1e3) / procs
            base = per_process if base is None else base
            rows.append({"benchmark": "layouts", "case": f"h{hidden} {name}", "ms/step": ms,
                         "tokens/s": per_process, "ratio": per_process / base})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model (checks the harness)")
    rows = run(p.parse_args(argv).quick)
    print(f"{'layout':<24}{'ms/iteration':>14}{'tokens/s per process':>22}{'vs 1 process':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<24}  FAILED: {r['error']}")
        else:
            print(f"{r['case']:<24}{r['ms/step']:14.0f}{r['tokens/s']:22.0f}{r['ratio']:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
