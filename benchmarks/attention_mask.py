"""Document masks on CPU: the attention mask object (one fused causal SDPA per document) against
Megatron-LM's dense ``[b, 1, s, s]`` mask (SDPA with ``attn_mask``), side by side in one run.

One packed sequence (b = 1) of documents with lengths drawn from 1..1024 tokens (seeded), 8
query heads in 2 key/value groups of width 64, fp32, one thread. A step builds the mask from the
document ids (the dense tensor for ``dense``; nothing for ``documents``) and runs attention forward
and backward. ``causal`` (one causal SDPA over the whole sequence, documents ignored) is the
fused path's figure for scale. Each case runs in its own process (a clean high-water mark):

* ``ms/step``: median wall time of 3 steps after a warm-up;
* ``peak MB``: the step's peak resident memory above the memory before it (``VmHWM`` after,
  ``VmRSS`` before, as ``benchmarks/context_parallel.py``);
* ``saved MB``: what autograd keeps for backward (the dense mask included);
* ``mask MB``: the bytes of the mask the step builds.

Llama 4's chunked attention (``--attention-chunk-size``, chunks of s/4 tokens, no documents):
``chunks`` (one causal SDPA per chunk, :func:`megatron.model.chunked_attention.chunked_attention`)
against ``chunks dense`` (SDPA with the dense ``[1, 1, s, s]`` chunked causal mask).

Ratios are dense over documents, and chunks dense over chunks (how many times the dense mask
costs). Usage:
``python benchmarks/attention_mask.py [--quick]`` (``--quick``: 1024 tokens); ``run(quick)``
returns the rows for run_all.py. Linux only (``/proc``).
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

SEQ = {False: 4096, True: 1024}
CASES = ("documents", "dense", "causal", "chunks", "chunks dense")
BASE = {"documents": "documents", "dense": "documents", "causal": "documents",
        "chunks": "chunks", "chunks dense": "chunks"}
STEPS = 3


def _document_ids(seq: int):
    import torch
    gen = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(1, 1025, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - seq
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[None], len(lengths)


def worker(seq: int, case: str) -> None:
    import torch

    from benchmarks.context_parallel import _saved_bytes, _status_kb
    from megatron.model.attention_mask import AttentionMask, masked_attention
    from megatron.model.chunked_attention import chunked_attention, chunked_cache_mask

    torch.set_num_threads(1)
    ids, docs = _document_ids(seq)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, seq, 64, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 2, seq, 64, generator=gen).requires_grad_() for _ in range(2))

    chunk = seq // 4

    def step():
        if case.startswith("chunks"):
            mask = None if case == "chunks" else AttentionMask.from_dense(
                chunked_cache_mask(0, seq, chunk, q.device))
            mask_bytes = 0 if mask is None else mask.dense.nbytes
            run = (lambda: chunked_attention(q, k, v, None, chunk)) if mask is None else (
                lambda: masked_attention(q, k, v, mask))
            out, saved = _saved_bytes(run, [q, k, v])
            out.sum().backward()
            return saved, mask_bytes
        mask = AttentionMask.from_document_ids(ids)
        if case == "dense":
            mask = AttentionMask.from_dense(mask.to_dense())
        elif case == "causal":
            mask = None
        mask_bytes = 0 if mask is None or mask.dense is None else mask.dense.nbytes
        out, saved = _saved_bytes(lambda: masked_attention(q, k, v, mask), [q, k, v])
        out.sum().backward()
        return saved, mask_bytes

    step()
    walls, peaks = [], []
    for _ in range(STEPS):
        q.grad = k.grad = v.grad = None
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kb("VmRSS")
        start = time.perf_counter()
        saved, mask_bytes = step()
        walls.append(time.perf_counter() - start)
        peaks.append(_status_kb("VmHWM") - before)
    print("RESULT " + json.dumps({"ms/step": sorted(walls)[STEPS // 2] * 1e3,
                                  "peak MB": max(peaks) / 1024, "saved MB": saved / 2 ** 20,
                                  "mask MB": mask_bytes / 2 ** 20, "documents": docs}), flush=True)


def _launch(seq: int, case: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(seq), case]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{case} s={seq} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run(quick: bool = False) -> list:
    """One row per case; ``... ratio`` columns are the case's figure over ``documents``'."""
    seq = SEQ[quick]
    results = {case: _launch(seq, case) for case in CASES}
    rows = []
    for case, r in results.items():
        base = results[BASE[case]]
        r.update({f"{k} ratio": r[k] / base[k] for k in ("ms/step", "peak MB", "saved MB")})
        rows.append({"benchmark": "attention_mask", "case": f"s{seq} {case}", **r})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1024 tokens (checks the harness)")
    p.add_argument("--worker", nargs=2, metavar=("SEQ", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:  # one case in this process (run() launches one per case)
        worker(int(args.worker[0]), args.worker[1])
        return 0
    rows = run(args.quick)
    print(f"{'case':<18}{'docs':>6}{'ms/step':>10}{'ratio':>7}{'peak MB':>10}{'ratio':>7}"
          f"{'saved MB':>10}{'ratio':>7}{'mask MB':>9}")
    for r in rows:
        print(f"{r['case']:<18}{r['documents']:6d}{r['ms/step']:10.0f}{r['ms/step ratio']:7.2f}"
              f"{r['peak MB']:10.1f}{r['peak MB ratio']:7.2f}{r['saved MB']:10.1f}"
              f"{r['saved MB ratio']:7.2f}{r['mask MB']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
