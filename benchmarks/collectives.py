"""What one small gloo collective costs on this machine: wall time and CPU time per all-reduce.

The tests run every layout on CPU ranks over gloo, with models so small that a run's time is
mostly its collectives (a TP=2 x DP=2 sequence-parallel run makes about 50 per micro-batch's
forward and backward). This prints, for worlds of 2, 4 and 8 processes (one thread each,
``init_method=file://``), the wall milliseconds of one ``all_reduce`` of 16 fp32 values, the CPU
milliseconds each rank spends on it, and the share of that CPU spent in gloo's own threads
(``gloo_tcp_loop``, ``pt_gloo_runloop``; read from ``/proc/self/task``, Linux only). With more
ranks than cores the wall time also holds the wait for a peer to be scheduled.

Usage: python benchmarks/collectives.py [--quick]; ``run(quick)`` returns the rows for run_all.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

WORLDS = {False: (2, 4, 8), True: (2, 4)}
CALLS = {False: 2000, True: 200}


def _thread_cpu() -> dict:
    """``{thread id: (name, CPU seconds)}`` of this process (empty where /proc is absent)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _rank(rank: int, world: int, init_file: str, calls: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    t = torch.ones(16)
    for _ in range(10):  # connections made, threads started
        dist.all_reduce(t)
    dist.barrier()
    before, cpu0, t0 = _thread_cpu(), time.process_time(), time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = _thread_cpu()
    gloo = sum(c - before.get(tid, (name, 0.0))[1] for tid, (name, c) in after.items()
               if "gloo" in name)
    results.put((rank, wall / calls, cpu / calls, gloo / cpu if after and cpu > 0 else None))
    dist.barrier()
    dist.destroy_process_group()


def _measure(world: int, calls: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "rendezvous"), calls,
                                                 results)) for r in range(world)]
        for p in procs:
            p.start()
        got = [results.get(timeout=600) for _ in range(world)]
        for p in procs:
            p.join(timeout=60)
    shares = [g[3] for g in got if g[3] is not None]
    return {"benchmark": "collectives", "case": f"all_reduce of 16 fp32, {world} ranks",
            "ranks per core": round(world / (os.cpu_count() or 1), 2),
            "ms/collective": 1e3 * max(g[1] for g in got),
            "CPU ms/collective/rank": 1e3 * sum(g[2] for g in got) / world,
            "gloo CPU share": sum(shares) / len(shares) if shares else float("nan")}


def run(quick: bool = False) -> list:
    return [_measure(world, CALLS[quick]) for world in WORLDS[quick]]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 and 4 ranks, 200 calls each")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    print(f"{'case':36} {'ranks/core':>10} {'ms/coll':>8} {'CPU ms/coll/rank':>17} "
          f"{'gloo CPU share':>15}")
    for row in rows:
        print(f"{row['case']:36} {row['ranks per core']:>10.2f} {row['ms/collective']:>8.3f} "
              f"{row['CPU ms/collective/rank']:>17.3f} {row['gloo CPU share']:>15.0%}")


if __name__ == "__main__":
    sys.exit(main())
