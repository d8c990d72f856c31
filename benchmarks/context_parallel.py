"""Context parallelism on CPU: per-rank peak memory and step time of one long sequence at CP = 1, 2, 4.

A tiny LLaMA (2 layers, hidden 128, 4 heads in 2 groups, vocabulary 1024) runs forward and
backward on one sequence of 8192 tokens (``--quick``: 1024), split over CP processes (gloo, one
thread each) with the load-balanced split of :mod:`megatron.core.context_parallel`, for both
``--cp-comm-type`` values. Per rank and step, taking the worst rank:

* ``peak MB``: the step's peak resident memory above the memory before it (``VmHWM`` after the
  step minus ``VmRSS`` before, the high-water mark reset through ``/proc/self/clear_refs``; glibc
  returns every allocation above 128 KiB on free, so the previous step's memory is not reused):
  activations, gradients being formed, the attention's transient buffers;
* ``saved MB``: the bytes autograd keeps for backward (``saved_tensors_hooks``, each storage once,
  parameters excluded), the quantity that should be exactly 1/CP;
* ``ms/step`` (wall) and ``cpu ms/step`` (the process's CPU time): on a 2-core machine 4
  processes share the cores, so the wall time of CP = 4 includes waiting for a core; CPU time is
  the work one rank does.

Ratios are against CP = 1 (the same sequence in one process). Usage:
``python benchmarks/context_parallel.py [--quick]``; ``run(quick)`` returns the rows for
run_all.py. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

SIZES = (1, 2, 4)
SEQ = {False: 8192, True: 1024}
STEPS = 3  # timed steps after one warm-up step


def _status_kb(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _saved_bytes(fn, exclude):
    """``(fn(), bytes of the storages autograd saves for backward)``, excluding ``exclude``."""
    import torch

    skip = {t.untyped_storage()._cdata for t in exclude}
    kept = {}

    def pack(t):
        if t.untyped_storage()._cdata not in skip:
            kept.setdefault(t.untyped_storage()._cdata, t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(t.untyped_storage().nbytes() for t in kept.values())


def worker(seq: int, comm_type: str) -> None:
    """One rank (under torchrun): build the model, run the steps, print rank 0's JSON line with
    the worst rank's figures."""
    import torch
    import torch.distributed as dist

    from megatron.config import ModelConfig
    from megatron.core import parallel_state as ps
    from megatron.core.context_parallel import (context_parallel_positions,
                                                split_for_context_parallel)
    from megatron.model.llama import LlamaModel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    groups = ps.initialize_model_parallel(1, 1, context_parallel_size=cp)
    config = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                         num_query_groups=2, padded_vocab_size=1024, max_position_embeddings=seq,
                         context_parallel_size=cp, cp_comm_type=comm_type)
    model = LlamaModel(config, pg_collection=groups)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1024, (1, seq + 1), generator=gen)
    ids, labels = (split_for_context_parallel(t, cp, groups.cp.rank)
                   for t in (tokens[:, :-1], tokens[:, 1:]))
    positions = context_parallel_positions(seq, 1, cp, groups.cp.rank)
    params = list(model.parameters())

    def step():
        loss, saved = _saved_bytes(lambda: model(ids, positions, labels=labels).sum(), params)
        loss.backward()
        return saved

    step()  # warm-up: gradients allocated, allocator and thread pool settled
    walls, cpus, peaks = [], [], []
    for _ in range(STEPS):
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        before = _status_kb("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        saved = step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        peaks.append(_status_kb("VmHWM") - before)
    mine = torch.tensor([sorted(walls)[STEPS // 2], sorted(cpus)[STEPS // 2], max(peaks) / 1024,
                         saved / 2 ** 20], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the worst rank
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"ms/step": mine[0].item() * 1e3,
                                      "cpu ms/step": mine[1].item() * 1e3,
                                      "peak MB": mine[2].item(), "saved MB": mine[3].item()}),
              flush=True)
    dist.destroy_process_group()


def _launch(cp: int, seq: int, comm_type: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
           os.path.abspath(__file__), "--worker", "--seq", str(seq), "--cp-comm-type", comm_type]
    # Every allocation above 128 KiB its own mapping, returned on free: glibc's adaptive
    # threshold would otherwise keep the previous step's freed tensors resident in the heap,
    # and the next step's peak would hide in them.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"CP={cp} {comm_type} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run(quick: bool = False) -> list:
    """One row per (CP, comm type): the worst rank's figures and their ratios to CP = 1."""
    seq, rows = SEQ[quick], []
    base = _launch(1, seq, "p2p")
    rows.append({"benchmark": "context_parallel", "case": f"s{seq} CP=1", **base})
    for cp in SIZES[1:]:
        for comm_type in ("p2p", "all_gather"):
            r = _launch(cp, seq, comm_type)
            r.update({f"{k} ratio": r[k] / base[k] for k in ("peak MB", "saved MB", "ms/step",
                                                              "cpu ms/step")})
            rows.append({"benchmark": "context_parallel", "case": f"s{seq} CP={cp} {comm_type}", **r})
    for r in rows[:1]:
        r.update({f"{k} ratio": 1.0 for k in ("peak MB", "saved MB", "ms/step", "cpu ms/step")})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1024 tokens (checks the harness)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cp-comm-type", default="p2p", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.seq, args.cp_comm_type)
        return 0
    rows = run(args.quick)
    print(f"{'case':<22}{'peak MB':>9}{'ratio':>7}{'saved MB':>10}{'ratio':>7}{'ms/step':>10}"
          f"{'ratio':>7}{'cpu ms/step':>13}{'ratio':>7}")
    for r in rows:
        print(f"{r['case']:<22}{r['peak MB']:9.1f}{r['peak MB ratio']:7.2f}{r['saved MB']:10.1f}"
              f"{r['saved MB ratio']:7.2f}{r['ms/step']:10.0f}{r['ms/step ratio']:7.2f}"
              f"{r['cpu ms/step']:13.0f}{r['cpu ms/step ratio']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
