"""Time and peak memory of converting a synthetic LLaMA (~1B parameters by default) on CPU,
printed beside the size of the largest output shard.

    python benchmarks/convert.py [--layers 16 --hidden 2048 --ffn 5504 --vocab 32000] \\
        [--tp 2 --pp 2] [--dtype bf16] [--workdir DIR]

Steps (each conversion in a fresh process): write a random HF folder (sharded safetensors,
streamed layer by layer), convert HF -> ours at TP x PP, then ours -> HF.

Memory: ``peak_anon_GiB`` is the peak of ``RssAnon`` (/proc/self/status, sampled every 2 ms by a
thread inside the converting process) minus its value right after the imports: the memory the
conversion itself holds. ``ru_maxrss`` is printed beside it but also counts file-backed pages of
memory-mapped inputs (safetensors, and torch checkpoints loaded with mmap), which the kernel can drop.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def write_synthetic_hf(folder, a):
    import torch
    from tools.checkpoint.saver_hf import save_checkpoint

    h, f, v, d = a.hidden, a.ffn, a.vocab, a.hidden // a.heads
    meta = {"num_layers": a.layers, "hidden_size": h, "ffn_hidden_size": f,
            "num_attention_heads": a.heads, "num_query_groups": a.groups, "kv_channels": d,
            "true_vocab_size": v, "max_position_embeddings": 4096, "norm_epsilon": 1e-5,
            "rotary_base": 10000.0, "rope_scaling": None, "untie_embeddings_and_output_weights": True}
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    r = lambda *s: torch.randn(*s, dtype=dt) * 0.02  # noqa: E731

    def stream():
        yield "embeddings", {"word_embeddings": r(v, h)}
        for _ in range(a.layers):
            yield "layer", {"input_norm": torch.ones(h, dtype=dt), "q": r(h, h),
                            "k": r(a.groups * d, h), "v": r(a.groups * d, h), "o": r(h, h),
                            "post_norm": torch.ones(h, dtype=dt), "gate": r(f, h), "up": r(f, h),
                            "down": r(h, f)}
        yield "final", {"final_norm": torch.ones(h, dtype=dt), "output_layer": r(v, h)}

    ns = argparse.Namespace(target_tensor_parallel_size=1, target_pipeline_parallel_size=1,
                            target_params_dtype=a.dtype, max_shard_size=2 * 10**9, tokenizer_dir=None,
                            save_dir=folder)
    save_checkpoint(meta, stream(), ns)
    return 2 * v * h + a.layers * (2 * h * h + 2 * a.groups * d * h + 3 * h * f)


def rss_anon_kib() -> int:
    """This process's anonymous resident memory (``RssAnon``, KiB; Linux only)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no RssAnon (Linux >= 4.5 needed)")


def child(argv) -> None:
    """Run one conversion in this process; print a JSON line of seconds and memory peaks."""
    import threading

    import safetensors.torch  # noqa: F401  (imports outside the measured delta)
    from tools.checkpoint import convert

    for module in list(convert.LOADERS.values()) + list(convert.SAVERS.values()):
        __import__(f"tools.checkpoint.{module}")
    convert.return_freed_memory_to_os()  # as the command line does
    base = rss_anon_kib()
    peak, done = [base], threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], rss_anon_kib())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t = time.perf_counter()
    convert.main(argv)
    seconds = time.perf_counter() - t
    done.set()
    thread.join()
    peak[0] = max(peak[0], rss_anon_kib())
    print(json.dumps({"seconds": seconds, "anon_kib": peak[0] - base,
                      "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def timed_convert(argv):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(argv)],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["seconds"], r["anon_kib"] / 2**20, r["maxrss_kib"] / 2**20


def largest(pattern):
    return max(os.path.getsize(p) for p in glob.glob(pattern, recursive=True)) / 2**30


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5504)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--workdir", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--write-to", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        return child(json.loads(a.child))
    if a.write_to is not None:
        return print(write_synthetic_hf(a.write_to, a))
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        hf, ours, back = (os.path.join(tmp, n) for n in ("hf", "ours", "back"))
        # in its own process too: a child forked from a big parent inherits its ru_maxrss
        # (Linux keeps the high-water mark across fork + exec)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--write-to", hf]
                             + sys.argv[1:], capture_output=True, text=True, check=True)
        n = int(out.stdout.split()[-1])
        idle = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        model_gib = n * {"bf16": 2, "fp32": 4}[a.dtype] / 2**30
        h, f, d = a.hidden, a.ffn, a.hidden // a.heads
        per_param = model_gib / n
        layer_gib = (2 * h * h + 2 * a.groups * d * h + 3 * h * f) * per_param
        print(f"model: {n / 1e9:.2f} B parameters, {a.dtype}, {model_gib:.2f} GiB (one layer "
              f"{layer_gib:.3f} GiB, embedding {a.vocab * h * per_param:.3f} GiB, output layer "
              f"the same); writer process peak {idle:.2f} GiB")
        rows = [("hf -> megatron TP=%d PP=%d" % (a.tp, a.pp),
                 ["--loader", "hf", "--saver", "megatron", "--load-dir", hf, "--save-dir", ours,
                  "--target-tensor-parallel-size", str(a.tp), "--target-pipeline-parallel-size", str(a.pp)],
                 os.path.join(ours, "release", "*", "model_optim_rng.pt")),
                ("megatron -> hf (2 GB shards)",
                 ["--loader", "megatron", "--saver", "hf", "--load-dir", ours, "--save-dir", back,
                  "--max-shard-size", "2GB"], os.path.join(back, "*.safetensors"))]
        for name, argv, outputs in rows:
            seconds, anon, maxrss = timed_convert(argv)
            print(json.dumps({"conversion": name, "seconds": round(seconds, 1),
                              "peak_anon_GiB": round(anon, 2), "ru_maxrss_GiB": round(maxrss, 2),
                              "largest_output_shard_GiB": round(largest(outputs), 2),
                              "model_GiB": round(model_gib, 2)}), flush=True)


if __name__ == "__main__":
    main()
