"""Distributed optimizer on CPU, DP=2 gloo processes: traffic, memory, overlap and iteration time.

Prints, in one run:

* elements and bytes each rank sends per iteration (ring: a reduce-scatter or all-gather of X
  elements sends X (N-1)/N) for our scheme (one reduce-scatter and one all-gather per bucket per
  iteration, counted from the collectives actually issued) and for the per-micro-batch scheme of
  Megatron-LLaMA's overlapped optimizer (a reduce-scatter per bucket per micro-batch), at 1, 4 and
  8 micro-batches;
* memory per rank (parameters, gradient buffer, optimizer state) for plain DP with AdamW, ours,
  and the formulas 16 Psi and 8 Psi + 8 Psi / N (fp32);
* median iteration time for plain DP, and ours without overlap, with --overlap-grad-reduce, and
  with both overlaps; how many reduce-scatters were launched before the backward produced its last
  gradient (target: buckets - 1) and how many all-gathers were still in flight when the next
  forward started.

Usage: ``python benchmarks/distrib_optimizer.py [--quick]`` (quick: smaller model, fewer steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DP = 2


def _model(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _setup(width, depth, bucket, *, distributed, overlap_grad=False, overlap_param=False):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    groups = ps.get_process_groups()
    ddp = DistributedDataParallel(_model(width, depth), data_parallel_group=groups.dp_cp.group,
                                  bucket_size=bucket, overlap_grad_reduce=overlap_grad,
                                  use_distributed_optimizer=distributed,
                                  overlap_param_gather=overlap_param)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=distributed),
                                 [ddp], pg_collection=groups)
    return ddp, opt


def _iteration(ddp, opt, width, num_mb, batch=8):
    from megatron.core.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    opt.zero_grad()
    in_flight = ddp.param_gathers_in_flight()  # all-gathers not done as the forward starts
    for i in range(num_mb):
        x = torch.randn(batch, width)
        if i < num_mb - 1:
            with ddp.no_sync():
                ddp(x).square().mean().backward()
        else:
            ddp(x).square().mean().backward()
    from megatron.core import parallel_state as ps
    finalize_model_grads([ddp], pg_collection=ps.get_process_groups())
    opt.step()
    return in_flight


def _optimizer_state_bytes(opt):
    if hasattr(opt, "state_bytes"):
        return opt.state_bytes()
    return sum(t.numel() * t.element_size() for s in opt.optimizer.state.values()
               for k, t in s.items() if k in ("exp_avg", "exp_avg_sq"))


def _worker(rank, init_file, quick, out_file):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=DP)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import collectives

    ps.initialize_model_parallel(1, 1)
    width, depth, steps = (256, 8, 6) if quick else (1024, 8, 12)
    bucket = 2 * width * width  # about two layers per bucket -> depth / 2 buckets
    res = {"traffic": {}, "time": {}}
    ddp, opt = _setup(width, depth, bucket, distributed=True, overlap_grad=True, overlap_param=True)
    psi = sum(p.numel() for p in ddp.module.parameters())
    buckets = ddp.buffers[0].buckets
    res.update(psi=psi, psi_pad=sum(b.numel_padded for b in buckets), buckets=len(buckets))
    for m in (1, 4, 8):
        _iteration(ddp, opt, width, m)
        with collectives.recording() as events:
            _iteration(ddp, opt, width, m)
        res["traffic"][m] = {op: sum(e["numel"] for e in events if e["op"] == op)
                             for op in ("reduce_scatter", "all_gather")}
    res["mem_ours"] = {"params": psi * 4, "grads": ddp.buffers[0].grad_data.numel() * 4,
                       "optimizer": _optimizer_state_bytes(opt)}

    configs = [("plain DP (all-reduce)", dict(distributed=False)),
               ("ours, no overlap", dict(distributed=True)),
               ("ours, --overlap-grad-reduce", dict(distributed=True, overlap_grad=True)),
               ("ours, both overlaps", dict(distributed=True, overlap_grad=True, overlap_param=True))]
    built = {name: _setup(width, depth, bucket, **kw) for name, kw in configs}
    plain_ddp, plain_opt = built["plain DP (all-reduce)"]
    _iteration(plain_ddp, plain_opt, width, 1)
    res["mem_plain"] = {"params": psi * 4, "grads": plain_ddp.buffers[0].grad_data.numel() * 4,
                        "optimizer": _optimizer_state_bytes(plain_opt)}
    times = {name: [] for name in built}
    extra = {}
    for _ in range(steps):  # interleaved rounds: machine drift hits every config alike
        for name, (d, o) in built.items():
            dist.barrier()
            start = time.perf_counter()
            in_flight = _iteration(d, o, width, 4)
            times[name].append(time.perf_counter() - start)
            extra[name] = (d.launched_before_last_grad, in_flight)
    for name in built:
        res["time"][name] = (statistics.median(times[name][1:]), *extra[name])
    if rank == 0:
        torch.save(res, out_file)
    dist.barrier()
    dist.destroy_process_group()


def _report(res):
    n, psi, pad = DP, res["psi"], res["psi_pad"]
    print(f"model: Psi = {psi:,} parameters, Psi_pad = {pad:,} ({pad / psi - 1:.4%} padding), "
          f"{res['buckets']} buckets, DP = {n}, fp32\n")
    print("sent per rank per iteration (ring: X (N-1)/N per collective), elements / MB")
    print(f"{'micro-batches':>14} {'ours measured':>22} {'ours formula':>14} {'per-micro-batch RS':>20}")
    for m, t in res["traffic"].items():
        ours = (t["reduce_scatter"] + t["all_gather"]) * (n - 1) // n
        formula = 2 * pad * (n - 1) // n
        per_mb = (m + 1) * pad * (n - 1) // n
        print(f"{m:>14} {ours:>12,} /{ours * 4 / 1e6:>6.2f} MB {formula:>14,} "
              f"{per_mb:>12,} /{per_mb * 4 / 1e6:>5.2f} MB")
    print("\nmemory per rank, MB (params + grads + optimizer state)")
    for name, mem in (("plain DP + AdamW", res["mem_plain"]), ("distributed optimizer", res["mem_ours"])):
        total = sum(mem.values())
        print(f"  {name:<24} {mem['params'] / 1e6:7.2f} + {mem['grads'] / 1e6:7.2f} + "
              f"{mem['optimizer'] / 1e6:7.2f} = {total / 1e6:7.2f}")
    print(f"  {'formula plain 16 Psi':<24} {16 * psi / 1e6:7.2f}; "
          f"formula ours 8 Psi + 8 Psi_pad/N = {(8 * psi + 8 * pad / n) / 1e6:.2f}")
    print(f"\niteration time, 4 micro-batches (median)        RS launched before last grad "
          f"(target {res['buckets'] - 1})   AG in flight at next forward")
    for name, (t, launched, in_flight) in res["time"].items():
        print(f"  {name:<30} {t * 1e3:8.1f} ms   {launched:>10}   {in_flight:>10}")


def _measure(quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), quick, out), nprocs=DP, join=True)
        return torch.load(out, weights_only=True)


def rows_of(res: dict) -> list:
    """Table rows for ``benchmarks/run_all.py``: MB sent per rank (measured vs the formula
    ``2 Psi_pad (N-1)/N``), state MB per rank (measured vs ``8 Psi + 8 Psi_pad / N``), times."""
    n, psi, pad = DP, res["psi"], res["psi_pad"]
    rows = []
    for m, t in res["traffic"].items():
        sent = (t["reduce_scatter"] + t["all_gather"]) * (n - 1) // n
        rows.append({"benchmark": "distrib_optimizer", "case": f"MB sent/rank, {m} micro-batches",
                     "measured": sent * 4 / 1e6, "theory": 2 * pad * (n - 1) // n * 4 / 1e6})
    for name, mem, theory in (("plain DP + AdamW", res["mem_plain"], 16 * psi),
                              ("distributed optimizer", res["mem_ours"], 8 * psi + 8 * pad / n)):
        rows.append({"benchmark": "distrib_optimizer", "case": f"state MB/rank, {name}",
                     "measured": sum(mem.values()) / 1e6, "theory": theory / 1e6})
    for name, (t, _, _) in res["time"].items():
        rows.append({"benchmark": "distrib_optimizer", "case": f"iteration, {name}",
                     "ms/step": t * 1e3})
    return rows


def run(quick: bool = False) -> list:
    """Rows for ``benchmarks/run_all.py`` (DP = 2 processes)."""
    return rows_of(_measure(quick))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    args = parser.parse_args(argv)
    _report(_measure(args.quick))


if __name__ == "__main__":
    main()
