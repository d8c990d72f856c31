"""Mixture of experts on CPU: all-to-all bytes, grouped GEMM, MoE vs dense, EP=2 vs EP=1.

A stack of ``--layers`` residual MoE blocks ``x + MoELayer(x)`` (``--experts`` SwiGLU experts of
width ``--ffn``, top-``--topk``, hidden ``--hidden``, fp32, one thread per process, forward and
backward of ``--tokens`` tokens per rank and micro-batch, ``--microbatches`` per iteration). One
run prints every figure beside its reference:

* ``a2a bytes``: the floating-point bytes one rank sends through the alltoall dispatcher per
  iteration at EP=2 (counted at ``all_to_all_single``, the other ranks' rows only), next to
  :func:`megatron.planner.moe.alltoall_bytes_per_iteration` (``4 T k h e (EP-1)/EP`` per MoE
  layer, uniform routing). With a balanced router (token t to experts on ranks ``t mod EP`` and
  ``t+1 mod EP``) the two are equal (asserted in tests/unit/benchmarks/test_moe_benchmark.py);
  with the layer's own router at initialisation the ratio shows the routing's imbalance;
* ``grouped GEMM``: the local experts' forward and backward on ``T k`` rows sorted by expert
  (even split), ``torch._grouped_mm`` against the per-expert loop (ratio: time / the loop's);
* ``MoE vs dense``: the MoE stack against a dense stack of SwiGLU MLPs of width ``k f`` (the same
  active parameters per token, the router's ``E h`` aside), ms per iteration and the ratio;
* ``EP=2 vs EP=1``: two processes, each with its own tokens: EP=1 (each holds every expert, no
  communication) against EP=2 (each holds half, two all-to-alls per layer and direction); the
  slower rank's median ms per iteration and the ratio EP=2 / EP=1.

Usage: ``python benchmarks/moe.py [--quick] [--hidden 256] [--ffn 256] [--experts 8]
[--topk 2] [--layers 2] [--tokens 1024] [--microbatches 2] [--steps 5]``; ``run(quick)``
returns the rows for run_all.py. The figures of a run are in docs/moe.md.
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

FULL = dict(hidden=256, ffn=256, experts=8, topk=2, layers=2, tokens=1024, microbatches=2,
            steps=5)
QUICK = dict(hidden=64, ffn=64, experts=4, topk=2, layers=2, tokens=128, microbatches=2,
             steps=2)


class MoEStack(torch.nn.Module):
    """``layers`` residual blocks ``x + MoELayer(x)``; the experts spread over ``ep_group``."""

    def __init__(self, hidden, ffn, experts, topk, layers, ep_group=None, grouped_gemm=True):
        from megatron.core.transformer.moe.moe_config import MoEConfig
        from megatron.core.transformer.moe import MoELayer

        super().__init__()
        cfg = MoEConfig(num_experts=experts, moe_router_topk=topk, moe_grouped_gemm=grouped_gemm)
        self.blocks = torch.nn.ModuleList(
            MoELayer(cfg, hidden_size=hidden, ffn_hidden_size=ffn, seed=1234, layer_number=i + 1,
                     num_layers=layers, ep_group=ep_group) for i in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


class DenseStack(torch.nn.Module):
    """``layers`` residual blocks ``x + SwiGLUMLP(x)`` of width ``ffn`` (the model's MLP)."""

    def __init__(self, hidden, ffn, layers):
        from megatron.config import ModelConfig
        from megatron.core.process_groups import ProcessGroupCollection
        from megatron.model.mlp import SwiGLUMLP

        super().__init__()
        config = ModelConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                             num_attention_heads=1, padded_vocab_size=128,
                             max_position_embeddings=16)
        groups = ProcessGroupCollection.world_of_one()
        self.blocks = torch.nn.ModuleList(SwiGLUMLP(config, i + 1, pg_collection=groups)
                                          for i in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def balanced_router(ep: int, experts: int):
    """A context manager: every router sends token t to the first expert of EP rank
    ``t mod EP`` and of ``(t + 1) mod EP`` (top-2; logits raised by 30), so with T a multiple of
    EP exactly ``1/EP`` of a rank's choices stay local, the planner's uniform routing."""
    import contextlib

    from megatron.core.transformer.moe.router import TopKRouter

    plain = TopKRouter.logits

    def logits(self, x):
        out = plain(self, x)
        t = torch.arange(out.shape[0])
        bump = torch.zeros_like(out)
        local = experts // ep
        bump[t, (t % ep) * local] = 30.0
        bump[t, ((t + 1) % ep) * local] = 30.0
        return out + bump

    @contextlib.contextmanager
    def patched():
        TopKRouter.logits = logits
        try:
            yield
        finally:
            TopKRouter.logits = plain
    return patched()


def counted_alltoall():
    """A context manager yielding a list that collects the floating-point bytes this rank sends
    to the other ranks of each ``all_to_all_single`` of the dispatcher (not the token counts)."""
    import contextlib

    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.dist.all_to_all_single
    sent = []

    def counted(out, inp, output_splits=None, input_splits=None, group=None, **kw):
        if inp.is_floating_point():
            me = dist.get_rank(group)
            rows = sum(n for j, n in enumerate(input_splits) if j != me)
            sent.append(rows * inp[0].numel() * inp.element_size())
        return original(out, inp, output_splits, input_splits, group=group, **kw)

    @contextlib.contextmanager
    def patched():
        token_dispatcher.dist.all_to_all_single = counted
        try:
            yield sent
        finally:
            token_dispatcher.dist.all_to_all_single = original
    return patched()


def _inputs(shape, seed, microbatches):
    """``microbatches`` inputs ``[s, b, h]`` of this rank (seeded by ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(microbatches)]


def iteration(model, inputs):
    """One iteration: forward and backward of every micro-batch (gradients accumulate)."""
    for x in inputs:
        model(x.requires_grad_()).square().mean().backward()


def median_ms(fn, steps):
    """Median wall time of ``fn()`` over ``steps`` calls after one warm-up call, in ms."""
    fn()
    times = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _shape(p):
    return (p["tokens"] // 4, 4, p["hidden"])  # [s, b, h]: s x 4 sequences


def measure_alltoall(p, balanced: bool) -> int:
    """Bytes this rank sends through the dispatcher in one iteration of the MoE stack over the
    world's ranks as one EP group (collective: every rank calls it)."""
    import contextlib

    ep = dist.get_world_size()
    if balanced and p["topk"] != 2:
        raise ValueError(f"the balanced router is top-2 (--topk {p['topk']})")
    group = dist.new_group(list(range(ep)))
    model = MoEStack(p["hidden"], p["ffn"], p["experts"], p["topk"], p["layers"], group)
    inputs = _inputs(_shape(p), 100 + dist.get_rank(), p["microbatches"])
    route = balanced_router(ep, p["experts"]) if balanced else contextlib.nullcontext()
    with route, counted_alltoall() as sent:
        iteration(model, inputs)
    return sum(sent)


def _worker(rank, world, init_file, p, queue):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    out = {"a2a random": measure_alltoall(p, False), "a2a balanced": measure_alltoall(p, True)}
    inputs = _inputs(_shape(p), 100 + rank, p["microbatches"])
    ep2 = MoEStack(p["hidden"], p["ffn"], p["experts"], p["topk"], p["layers"],
                   dist.new_group(list(range(world))))
    ep1 = MoEStack(p["hidden"], p["ffn"], p["experts"], p["topk"], p["layers"])
    times = torch.tensor([median_ms(lambda: iteration(ep1, inputs), p["steps"]),
                          median_ms(lambda: iteration(ep2, inputs), p["steps"])],
                         dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slower rank
    out["ep1 ms"], out["ep2 ms"] = times.tolist()
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def _two_ranks(p) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, 2, init, p, queue)) for r in range(2)]
        for pr in procs:
            pr.start()
        results = dict(queue.get(timeout=1800) for _ in procs)
        for pr in procs:
            pr.join()
    return results


def _grouped_vs_loop(p) -> dict:
    """The local experts alone on ``T k`` rows, split evenly: ms per forward and backward."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    e, rows = p["experts"], p["tokens"] * p["topk"]
    counts = torch.full((e,), rows // e, dtype=torch.int64)
    x = torch.randn(int(counts.sum()), p["hidden"], generator=torch.Generator().manual_seed(0))
    out = {}
    for name, grouped in (("loop", False), ("grouped", True)):
        experts = GroupedMLP(e, p["hidden"], p["ffn"], first_expert=0, seed=1, layer_number=1,
                             init_method_std=0.02, num_layers=1, grouped_gemm=grouped)
        assert experts.grouped_gemm == grouped

        def step():
            experts(x.requires_grad_(), counts).square().mean().backward()
        out[name] = median_ms(step, p["steps"] * p["microbatches"] * p["layers"])
    return out


def _moe_vs_dense(p) -> dict:
    inputs = _inputs(_shape(p), 7, p["microbatches"])
    moe = MoEStack(p["hidden"], p["ffn"], p["experts"], p["topk"], p["layers"])
    dense = DenseStack(p["hidden"], p["topk"] * p["ffn"], p["layers"])
    h, f, k, e, n = p["hidden"], p["ffn"], p["topk"], p["experts"], p["layers"]
    return {"moe ms": median_ms(lambda: iteration(moe, inputs), p["steps"]),
            "dense ms": median_ms(lambda: iteration(dense, inputs), p["steps"]),
            "moe active": n * (e * h + k * 3 * f * h),
            "dense active": sum(q.numel() for q in dense.parameters())}


def run(quick: bool = False, **overrides) -> list:
    """The rows (run_all.py's form): ``measured`` / ``theory`` for the bytes, ``ms/step`` and
    ``ratio`` for the times."""
    from megatron.planner.moe import alltoall_bytes_per_iteration

    p = dict(QUICK if quick else FULL, **overrides)
    torch.set_num_threads(1)
    two = _two_ranks(p)
    theory = alltoall_bytes_per_iteration(p["tokens"] * p["microbatches"], p["topk"], p["hidden"],
                                          4, ep=2, moe_layers_per_rank=p["layers"])
    rows = []
    for key, label in (("a2a balanced", "balanced router"), ("a2a random", "router at init")):
        sent = [two[r][key] for r in sorted(two)]
        for r, b in enumerate(sent):
            rows.append({"case": f"a2a bytes/iter EP=2 rank {r}, {label}", "measured": b,
                         "theory": theory, "ratio": b / theory})
    g = _grouped_vs_loop(p)
    rows.append({"case": "experts fwd+bwd: per-expert loop", "ms/step": g["loop"], "ratio": 1.0})
    rows.append({"case": "experts fwd+bwd: torch._grouped_mm", "ms/step": g["grouped"],
                 "ratio": g["grouped"] / g["loop"]})
    d = _moe_vs_dense(p)
    rows.append({"case": f"dense, same active ({d['dense active']})", "ms/step": d["dense ms"],
                 "ratio": 1.0})
    rows.append({"case": f"MoE E={p['experts']} top-{p['topk']} ({d['moe active']} active)",
                 "ms/step": d["moe ms"], "ratio": d["moe ms"] / d["dense ms"]})
    ep1, ep2 = two[0]["ep1 ms"], two[0]["ep2 ms"]
    rows.append({"case": "MoE iteration, 2 ranks, EP=1", "ms/step": ep1, "ratio": 1.0})
    rows.append({"case": "MoE iteration, 2 ranks, EP=2", "ms/step": ep2, "ratio": ep2 / ep1})
    for r in rows:
        r["benchmark"] = "moe"
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (checks the harness)")
    for key, value in FULL.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help=f"default {value} ({QUICK[key]} with --quick)")
    args = p.parse_args(argv)
    overrides = {k: getattr(args, k) for k in FULL if getattr(args, k) is not None}
    params = dict(QUICK if args.quick else FULL, **overrides)
    rows = run(args.quick, **overrides)
    print(", ".join(f"{k} {v}" for k, v in params.items()) + " (fp32, 1 thread per process)")
    print(f"{'case':<52}{'measured':>12}{'theory':>12}{'ms/iter':>10}{'ratio':>8}")
    for r in rows:
        cell = lambda k, fmt: format(r[k], fmt) if k in r else ""  # noqa: E731
        print(f"{r['case']:<52}{cell('measured', ',.0f'):>12}{cell('theory', ',.0f'):>12}"
              f"{cell('ms/step', '.1f'):>10}{cell('ratio', '.2f'):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
