"""Pipeline bubble of the 1F1B and interleaved 1F1B schedules, measured beside the theory.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 2.2): with ``p`` stages, ``m`` micro-batches and per-stage forward/backward
times ``t_f``/``t_b``, 1F1B idles ``(p - 1)(t_f + t_b)`` per stage, the bubble fraction of the
iteration is ``(p - 1) / (m + p - 1)``; with ``v`` model chunks per stage the idle time shrinks to
``(p - 1)(t_f + t_b) / v``, a fraction ``((p - 1) / v) / (m + (p - 1) / v)``.

Each stage runs our real schedules (``megatron.core.pipeline_parallel``) over gloo processes with
a *synthetic* compute: every forward of a model chunk sleeps ``t_f / v`` and every backward
``t_b / v``. Sleeping releases the CPU, so 4 processes on 2 cores measure the schedule, not the
oversubscription. Two numbers per case:

* ``measured``: ``1 - busy / makespan`` from wall clocks (busy: each rank's summed op time,
  makespan: first start to last finish over the ranks);
* ``from order``: the same fraction from the *order* of operations each rank recorded, replayed
  with exact durations and data dependencies (:func:`bubble_from_order`); it equals the theory
  exactly (``tests/unit/core/pipeline_parallel/test_bubble.py``), so the gap between ``measured`` and theory is the cost of
  communication and Python, not of the schedule.

Usage: ``python benchmarks/pipeline.py [--quick] [--tf-ms 20] [--tb-ms 40]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from fractions import Fraction

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HIDDEN, SEQ, MBS = 8, 4, 1


def theory(pp: int, m: int, v: int = 1) -> Fraction:
    """Bubble fraction of (interleaved) 1F1B: ``((p - 1) / v) / (m + (p - 1) / v)``."""
    idle = Fraction(pp - 1, v)
    return idle / (m + idle)


class _Op(torch.autograd.Function):
    """Identity whose forward and backward sleep and record ``(kind, chunk, start, end)``."""

    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        stage._run("F")
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.stage._run("B")
        return grad, None


class SleepStage(torch.nn.Module):
    """One model chunk: ``x * w`` then a recorded op sleeping ``fwd_s`` / ``bwd_s`` seconds."""

    def __init__(self, chunk: int, fwd_s: float, bwd_s: float, log: list):
        super().__init__()
        self.chunk, self.fwd_s, self.bwd_s, self.log = chunk, fwd_s, bwd_s, log
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def _run(self, kind):
        start = time.perf_counter()
        seconds = self.fwd_s if kind == "F" else self.bwd_s
        if seconds:
            time.sleep(seconds)
        self.log.append((kind, self.chunk, start, time.perf_counter()))

    def forward(self, x):
        h = x if self.input_tensor is None else self.input_tensor
        return _Op.apply(h * self.weight, self)


def _forward_step(data_iterator, model):
    x = next(data_iterator)
    out = model(x)
    return out, lambda output: (output.float().sum(), {"loss": output.detach().sum()})


def run_schedule(pp: int, v: int, m: int, tf_s: float = 0.0, tb_s: float = 0.0,
                 repeats: int = 1) -> dict:
    """In a gloo world of ``pp`` ranks: run the schedule ``repeats`` times (after one warm-up) and
    return this rank's ``order`` [(kind, chunk)], ``busy`` and ``window`` (start, end) seconds of
    the best repeat (all ranks start after a barrier)."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import PipelineConfig, get_forward_backward_func

    groups = ps.initialize_model_parallel(1, pp,
                                          virtual_pipeline_model_parallel_size=v if v > 1 else None)
    try:
        log: list = []
        chunks = [SleepStage(c, tf_s / v, tb_s / v, log) for c in range(v)]
        config = PipelineConfig(hidden_size=HIDDEN)
        fn = get_forward_backward_func(groups)
        best = None
        for rep in range(repeats + 1):
            data = [iter([torch.randn(SEQ, MBS, HIDDEN) for _ in range(m)]) for _ in range(v)]
            log.clear()
            dist.barrier()
            start = time.perf_counter()
            fn(forward_step_func=_forward_step, data_iterator=data if v > 1 else data[0],
               model=chunks if v > 1 else chunks[0], num_microbatches=m, seq_length=SEQ,
               micro_batch_size=MBS, forward_only=False, config=config, pg_collection=groups)
            end = time.perf_counter()
            result = {"order": [(k, c) for k, c, _, _ in log],
                      "busy": sum(e - s for _, _, s, e in log), "window": (start, end)}
            if rep and (best is None or end - start < best["window"][1] - best["window"][0]):
                best = result
        return best
    finally:
        ps.destroy_model_parallel()


def bubble_from_order(orders: list, pp: int, v: int, tf: Fraction = Fraction(1),
                      tb: Fraction = Fraction(2)) -> Fraction:
    """Bubble fraction of the recorded per-rank operation orders, replayed exactly.

    ``orders[r]`` is rank r's list of ``(kind, chunk)`` (kind ``"F"``/``"B"``); the i-th forward
    (backward) of a chunk is micro-batch i (both run in micro-batch order). Chunk c of rank r is
    virtual stage ``c * pp + r``; a forward waits for the previous virtual stage's forward of its
    micro-batch, a backward for the next stage's backward; each rank runs its ops in order, as
    soon as possible, forwards taking ``tf / v`` and backwards ``tb / v``.

    Returns:
        ``1 - m (tf + tb) / makespan`` (exact rational).

    Raises:
        ValueError: if the orders deadlock (an op waits for one that never runs first).
    """
    stages = pp * v
    ops = []
    for r, order in enumerate(orders):
        seen, mine = {}, []
        for kind, c in order:
            i = seen.get((kind, c), 0)
            seen[kind, c] = i + 1
            mine.append((kind, c * pp + r, i))
        ops.append(mine)
    done, free, pos = {}, [Fraction(0)] * pp, [0] * pp
    while any(pos[r] < len(ops[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(ops[r]):
                kind, stage, i = ops[r][pos[r]]
                dep = ((kind, stage - 1, i) if kind == "F" and stage > 0 else
                       (kind, stage + 1, i) if kind == "B" and stage < stages - 1 else None)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep is not None else Fraction(0))
                free[r] = done[kind, stage, i] = start + (tf if kind == "F" else tb) / v
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the recorded orders deadlock: an operation waits for one that a "
                             "rank schedules after its own")
    m = sum(1 for kind, _ in orders[0] if kind == "F") // v
    return 1 - m * (tf + tb) / max(free)


def _world(pp, cases, tf_s, tb_s, repeats):
    return [run_schedule(pp, v, m, tf_s, tb_s, repeats) for v, m in cases]


def measure(pp: int, cases: list, tf_s: float, tb_s: float, repeats: int) -> list:
    """Rows for ``cases`` [(v, m)] at PP=``pp``: measured, from-order and theoretical bubble."""
    from tests.helpers.dist import run_distributed

    per_rank = run_distributed(pp, _world, pp, cases, tf_s, tb_s, repeats, timeout=600)
    rows = []
    for k, (v, m) in enumerate(cases):
        ranks = [r[k] for r in per_rank]
        start = min(r["window"][0] for r in ranks)
        makespan = max(r["window"][1] for r in ranks) - start
        busy = sum(r["busy"] for r in ranks) / pp
        order = bubble_from_order([r["order"] for r in ranks], pp, v,
                                  Fraction(tf_s).limit_denominator(10 ** 6),
                                  Fraction(tb_s).limit_denominator(10 ** 6))
        rows.append({"benchmark": "pipeline", "case": f"{'1F1B' if v == 1 else f'interleaved v={v}'}"
                     f" PP={pp} m={m}", "measured": 1 - busy / makespan,
                     "from order": float(order), "theory": float(theory(pp, m, v)),
                     "ms/iteration": makespan * 1000})
    return rows


def run(quick: bool = False, tf_ms: float = 20.0, tb_ms: float = 40.0) -> list:
    """Every case: PP=2 and 4, 1F1B and interleaved (v=2), several micro-batch counts."""
    repeats = 1 if quick else 3
    rows = []
    for pp in (2, 4):
        ms = [pp, 2 * pp] if quick else [pp, 2 * pp, 4 * pp]
        cases = [(v, m) for m in ms for v in (1, 2)]
        rows += measure(pp, cases, tf_ms / 1000, tb_ms / 1000, repeats)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    parser.add_argument("--tf-ms", type=float, default=20.0, help="forward time per stage")
    parser.add_argument("--tb-ms", type=float, default=40.0, help="backward time per stage")
    args = parser.parse_args(argv)
    rows = run(args.quick, args.tf_ms, args.tb_ms)
    print(f"{'case':<28} {'measured':>9} {'from order':>11} {'theory':>8} {'ms/iter':>9}")
    for r in rows:
        print(f"{r['case']:<28} {r['measured']:9.3f} {r['from order']:11.3f} {r['theory']:8.3f} "
              f"{r['ms/iteration']:9.1f}")
    return rows


if __name__ == "__main__":
    main()
