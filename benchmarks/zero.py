"""ZeRO-1/2/3 and optimizer CPU offload on CPU, DP gloo processes: bytes per rank and iteration time.

A stack of ``--layers`` blocks (each two ``width x width`` linears: one ZeRO-3 unit) plus an
input and an output linear (the root unit), fp32 or ``--bf16``, trained with
``--overlap-grad-reduce`` on ``--microbatches`` micro-batches per iteration (buckets of
``--bucket-size`` elements, default one block's), for each strategy of
``--data-parallel-sharding-strategy`` (and ZeRO-3 with ``--optimizer-cpu-offload``). Prints per
rank, measured from the storages (``DistributedDataParallel.memory_bytes``, the optimizer's
``state_bytes``, the peak of gathered parameters and of full gradients) next to the formulas of
Megatron-FSDP (``e`` = 2 for bf16, 4 for fp32; ``Psi`` padded elements, ``N`` = DP):

* params: ZeRO-1/2 ``e Psi``; ZeRO-3 ``e Psi / N`` + the gather window (root + 2 blocks: the
  current one and the prefetched next);
* grads (held between iterations): ZeRO-1 ``4 Psi``; ZeRO-2/3 ``4 Psi / N``;
* peak grads over an iteration (measured by ``DistributedDataParallel.grad_meter`` from the
  gradient storages): ZeRO-1 ``4 Psi``; ZeRO-2 ``4 Psi / N`` + two buckets (the one filling and
  the previous one, reduce-scattered in flight: ``planner.memory.sharded_grad_window_numel``);
  ZeRO-3 ``4 Psi / N`` + the root unit + one block; with the ratio to ZeRO-1;
* optimizer: ``8 Psi / N`` (fp32) or ``12 Psi / N`` (bf16);

and the median iteration time (forward, backward, finalize, step) per strategy with the ratio to
ZeRO-1 (the distributed optimizer).

Usage: ``python benchmarks/zero.py [--dp 2] [--width 512] [--layers 8] [--steps 12] [--bf16]
[--microbatches 4] [--bucket-size N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [("ZeRO-1 (optim)", "optim", False), ("ZeRO-2 (optim_grads)", "optim_grads", False),
         ("ZeRO-3 (optim_grads_params)", "optim_grads_params", False),
         ("ZeRO-3 + --optimizer-cpu-offload", "optim_grads_params", True)]


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


class Net(torch.nn.Module):
    def __init__(self, width, layers):
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.out(x)


def _case(args, strategy, offload):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    groups = ps.get_process_groups()
    torch.manual_seed(0)
    net = Net(args.width, args.layers)
    if args.bf16:
        net = net.to(torch.bfloat16)
    ddp = DistributedDataParallel(net, data_parallel_group=groups.dp_cp.group,
                                  bucket_size=args.bucket_size or 2 * args.width * (args.width + 1),
                                  overlap_grad_reduce=True, use_distributed_optimizer=True,
                                  data_parallel_sharding_strategy=strategy,
                                  fsdp_unit_modules=(Block,))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=args.bf16,
                                                 use_distributed_optimizer=True,
                                                 optimizer_cpu_offload=offload),
                                 [ddp], pg_collection=groups)
    x = torch.randn(args.batch, args.width, dtype=next(net.parameters()).dtype)
    times = []
    for step in range(args.steps):
        if ddp.param_units is not None:
            ddp.param_units.reset_peak()
        dist.barrier()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        ddp.grad_meter.reset_peak()
        for i, xm in enumerate(x.chunk(args.microbatches)):
            with ddp.no_sync() if i < args.microbatches - 1 else contextlib.nullcontext():
                ddp(xm).float().pow(2).mean().backward()
        finalize_model_grads([ddp], pg_collection=groups)
        opt.step()
        times.append(time.perf_counter() - t0)
    mem = ddp.memory_bytes()
    psi = sum(b.numel_padded for buf in ddp.buffers for b in buf.buckets)
    units = ddp.param_units
    return {"time": statistics.median(times[2:]), "mem": mem, "psi": psi,
            "state": opt.state_bytes(), "window": units.peak_gathered_bytes if units else 0,
            "peak_grads": ddp.grad_meter.peak,
            "buckets": [b.numel_padded for buf in ddp.buffers for b in buf.buckets],
            "unit_numel": ([u.numel_padded() for u in units.units] if units else None)}


def _worker(rank, world, init_file, args, queue):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    out = [(name, _case(args, strategy, offload)) for name, strategy, offload in CASES]
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _report(results, args):
    from megatron.planner.memory import sharded_grad_window_numel

    n, e = args.dp, 2 if args.bf16 else 4
    base = results[0][1]["time"]
    mib = 1 / 2 ** 20
    print(f"DP={n}, {'bf16' if args.bf16 else 'fp32'}, width {args.width}, {args.layers} blocks "
          f"(+ input and output linear), batch {args.batch}, {args.steps} steps (median of the "
          "last ones); MiB per rank, measured / formula")
    print(f"{'strategy':34s} {'params':>15s} {'window':>15s} {'grads held':>15s} "
          f"{'grads peak':>15s} {'vs ZeRO-1':>9s} {'optimizer':>15s} {'iter ms':>8s} "
          f"{'vs ZeRO-1':>9s}")
    base_peak = results[0][1]["peak_grads"]
    for name, r in results:
        psi, mem = r["psi"], r["mem"]
        zero3 = "params" in name or "offload" in name
        sharded_grads = "ZeRO-1" not in name
        params = mem["param_shards"] if zero3 else mem["params"]
        f_params = e * psi / n if zero3 else e * psi
        window = 0
        if zero3:  # root + the two largest blocks (current and prefetched)
            units = r["unit_numel"]
            window = e * (units[0] + sum(sorted(units[1:])[-2:]))
        grads = mem["grad_shards"] if sharded_grads else mem["grads"]
        f_grads = 4 * psi / n if sharded_grads else 4 * psi
        f_state = (12 if args.bf16 or "offload" in name else 8) * psi / n
        if "offload" in name and not args.bf16:
            f_state = 12 * psi / n  # an fp32 host copy of the shards as well (in host memory)
        cell = lambda a, b: f"{a * mib:6.2f}/{b * mib:6.2f}"  # noqa: E731
        if not sharded_grads:
            f_peak = 4 * psi
        elif zero3:  # the root unit (live through the backward) and one block
            f_peak = 4 * psi / n + 4 * (units[0] + max(units[1:]))
        else:
            f_peak = 4 * psi / n + 4 * sharded_grad_window_numel(r["buckets"],
                                                                   overlap_grad_reduce=True)
        print(f"{name:34s} {cell(params, f_params):>15s} {cell(r['window'], window):>15s} "
              f"{cell(grads, f_grads):>15s} {cell(r['peak_grads'], f_peak):>15s} "
              f"{r['peak_grads'] / base_peak:9.2f} {cell(r['state'], f_state):>15s} "
              f"{r['time'] * 1e3:8.1f} {r['time'] / base:9.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--bucket-size", type=int, default=None,
                   help="elements per bucket (default: one block's two linears)")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, args.dp, init, args, queue))
                 for r in range(args.dp)]
        for pr in procs:
            pr.start()
        results = queue.get(timeout=1800)
        for pr in procs:
            pr.join()
    _report(results, args)
    return results


if __name__ == "__main__":
    main()
