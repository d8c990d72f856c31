"""Continuous against static batching of the same request stream, side by side in one run (CPU,
a small random LLaMA, fp32, one thread).

A burst of N requests (N = 1, 8, 32) arrives at once; prompts of 8..56 tokens and max_tokens of
8..64 (seeded, the same stream for every case); the batch holds 8 requests. Cases:

* ``static``: request-level batching: a batch of up to 8 is admitted into an empty engine and
  runs until its last request ends (one packed forward per step);
* ``continuous``: iteration-level batching: a finished request's slot is refilled at the next
  step (one packed forward per step);
* ``continuous, invariant``: continuous with one forward per request per step (the engine's
  default, bitwise batch invariant).

Figures: ``tok/s`` (generated tokens over the wall time of the whole stream), ``TTFT ms``
(median and worst time from arrival to the first token), ``steps``. Ratios are against static at
the same N. Usage: ``python benchmarks/serve.py [--quick]``; ``run(quick)`` returns the rows for
run_all.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CASES = (("static", dict(static=True, packed=True)),
         ("continuous", dict(packed=True)),
         ("continuous, invariant", dict()))


def _model(quick: bool):
    import torch

    from megatron.config import ModelConfig
    from megatron.core.process_groups import ProcessGroupCollection
    from megatron.model.llama import LlamaModel

    torch.manual_seed(0)
    config = ModelConfig(num_layers=2 if quick else 4, hidden_size=128 if quick else 256,
                         ffn_hidden_size=344 if quick else 688, num_attention_heads=8,
                         num_query_groups=2, padded_vocab_size=1024,
                         max_position_embeddings=256, seed=3)
    groups = ProcessGroupCollection.world_of_one()
    return LlamaModel(config, pg_collection=groups).eval(), groups


def _stream(n: int):
    import torch

    g = torch.Generator().manual_seed(n)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, 57, (1,), generator=g))
        max_tokens = int(torch.randint(8, 65, (1,), generator=g))
        out.append((torch.randint(0, 1000, (length,), generator=g).tolist(), max_tokens))
    return out


def measure(model, groups, n: int, case: dict) -> dict:
    from megatron.inference.engine import Engine, SamplingParams

    engine = Engine(model, groups, num_blocks=1024, block_size=16, max_batch_size=8,
                    max_tokens_per_step=512, prefill_chunk=64, **case)
    start = time.perf_counter()
    requests = [engine.requests[engine.add_request(p, SamplingParams(max_tokens=m, greedy=True,
                                                                     stop_at_eod=False))]
                for p, m in _stream(n)]
    for r in requests:
        r.arrival_time = start
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    ttft = [1e3 * (r.first_token_time - r.arrival_time) for r in requests]
    return {"tok/s": round(sum(len(r.output) for r in requests) / wall, 1),
            "TTFT ms p50": round(statistics.median(ttft), 1), "TTFT ms max": round(max(ttft), 1),
            "steps": steps, "outputs": [r.output for r in requests]}


def run(quick: bool = False) -> list:
    import torch

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model, groups = _model(quick)
    measure(model, groups, 2, dict(packed=True))  # warm-up (allocator, kernels)
    rows = []
    for n in (1, 8) if quick else (1, 8, 32):
        base = None
        for name, case in CASES:
            row = measure(model, groups, n, case)
            outputs = row.pop("outputs")
            if base is None:
                base, base_outputs = row, outputs
            row = {"benchmark": "serve", "case": f"N={n} {name}", **row,
                   "tok/s ratio": round(row["tok/s"] / base["tok/s"], 2),
                   "same tokens": outputs == base_outputs}
            rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller model, N = 1 and 8 only")
    args = p.parse_args(argv)
    rows = run(args.quick)
    columns = ["tok/s", "tok/s ratio", "TTFT ms p50", "TTFT ms max", "steps", "same tokens"]
    print(f"{'case':<28}" + "".join(f"{c:>14}" for c in columns))
    for r in rows:
        print(f"{r['case']:<28}" + "".join(f"{str(r[c]):>14}" for c in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
