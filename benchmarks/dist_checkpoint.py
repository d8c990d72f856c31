"""Checkpoint throughput: legacy (``--ckpt-format torch``) against ``torch_dist``, as a share of the
disk's sequential write speed measured in the same run; the training stall per save with and
without ``--async-save``; the peak extra memory of each save.

    python benchmarks/dist_checkpoint.py [--size small|1b|tiny] [--no-optimizer] [--repeats N]
                                         [--workdir DIR]

One process (a gloo world of one), a synthetic LLaMA (fp32 weights, layout-independent init)
and its Adam state (zero moments after one zero-gradient step; the values do not change the
bytes). ``--size 1b`` is about 1.1 B parameters: weights and Adam state are 13 GB in memory and on
disk and the legacy load holds a second copy, so it needs about 30 GB of RAM; with
``--no-optimizer`` (weights only) 4.4 GB.

* disk: ``min(checkpoint size, 2 GiB)`` written in 64 MiB blocks, then fsync (both formats fsync
  every file they write);
* save: seconds to a published checkpoint, GB/s = bytes of the folder / seconds, and that as a
  share of the disk's speed (``of ceiling``); load: the same for reading it back in place (the
  files are then in the page cache: a load measures deserialising, not the disk);
* stall: the time the training loop waits for a save: all of it when synchronous; with
  ``--async-save`` the hand-off plus the wait, before the next optimizer step, for the host copy
  made during the model's own forward and backward pass (one micro-batch ``[1, seq]``), the
  loop training on until the write ends. The slowdown of those steps is given apart (``steps
  during the async write``: their time against the same step measured before);
* peak GiB: the highest ``RssAnon`` during the operation minus its value before (sampled every
  2 ms): for the asynchronous save, the host copy of the state.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.convert import rss_anon_kib  # noqa: E402

SIZES = {"tiny": dict(layers=2, hidden=256, ffn=688, heads=4, groups=2, vocab=1024, seq=64),
         "small": dict(layers=8, hidden=1024, ffn=2816, heads=16, groups=4, vocab=32000, seq=256),
         "1b": dict(layers=22, hidden=2048, ffn=5504, heads=16, groups=4, vocab=32000, seq=256)}


class PeakMemory:
    """Highest ``RssAnon`` above the value at entry, sampled every 2 ms (GiB in ``.gib``)."""

    def __enter__(self):
        self.base = rss_anon_kib()
        self.peak, self._done = self.base, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.002):
            self.peak = max(self.peak, rss_anon_kib())

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.gib = (max(self.peak, rss_anon_kib()) - self.base) / 2**20
        return False


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def disk_write_gbps(folder: str, nbytes: int) -> float:
    """Sequential write speed of ``folder``'s disk: ``nbytes`` in 64 MiB blocks, then fsync."""
    block = bytes(64 << 20)
    path = os.path.join(folder, "disk_speed.bin")
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    written = os.path.getsize(path)
    os.remove(path)
    return written / seconds / 1e9


def build(size: dict):
    """A TP = PP = 1 LLaMA wrapped for DP, its optimizer (with Adam state) and scheduler."""
    from megatron.config import ModelConfig
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.model.llama import LlamaModel

    config = ModelConfig(num_layers=size["layers"], hidden_size=size["hidden"],
                         ffn_hidden_size=size["ffn"], num_attention_heads=size["heads"],
                         num_query_groups=size["groups"], padded_vocab_size=size["vocab"],
                         max_position_embeddings=4096, untie_embeddings_and_output_weights=True)
    groups = ps.get_process_groups()
    model = DistributedDataParallel(LlamaModel(config, pg_collection=groups),
                                    data_parallel_group=groups.dp_cp.group)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4), [model], pg_collection=groups)
    optimizer.step()  # zero gradients: creates the Adam state (moments and step)
    return [model], optimizer, sum(p.numel() for p in model.parameters())


class TrainStep:
    """The model's own training iteration on one random micro-batch ``[1, seq]``: forward and
    backward (timed apart), then the optimizer step; ``before_step`` runs between them, as
    ``train_step``'s ``before_optimizer_step`` (``--async-save`` waits there for its copy)."""

    def __init__(self, model, optimizer, vocab: int, seq: int):
        self.model, self.optimizer = model, optimizer
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (1, seq + 1), generator=generator)

    def __call__(self, before_step=None):
        """``(forward-backward seconds, seconds waiting in before_step)``."""
        chunk = self.model[0]
        chunk.zero_grad_buffer()
        start = time.perf_counter()
        loss = chunk(self.tokens[:, :-1], labels=self.tokens[:, 1:])
        loss.mean().backward()
        compute = time.perf_counter() - start
        start = time.perf_counter()
        if before_step is not None:
            before_step()
        waited = time.perf_counter() - start
        self.optimizer.step()
        return compute, waited


def _args(save_dir: str, with_optimizer: bool, fmt: str = "torch", async_save: bool = False):
    from megatron.config import CheckpointConfig

    return CheckpointConfig(save=save_dir, load=save_dir, no_save_optim=not with_optimizer,
                            no_load_optim=not with_optimizer, ckpt_format=fmt,
                            async_save=async_save)


def _save(model, optimizer, config, saver=None):
    from megatron.core import parallel_state as ps
    from megatron.training.train import TrainState, save_checkpoint

    state = TrainState(iteration=1)
    return save_checkpoint(config, state, model, optimizer, None, ps.get_process_groups(),
                           {"benchmark": "dist_checkpoint"}, saver)


def _load(model, optimizer, config, group) -> None:
    from megatron import checkpointing
    from megatron.core import parallel_state as ps

    checkpointing.load_checkpoint(model, optimizer, None, config, ps.get_process_groups(),
                                  run_flags={}, group=group)


def _save_and_load(fmt, model, optimizer, group, workdir, with_optimizer, results) -> int:
    """One save and one load in format ``fmt``: appends ``(seconds, peak GiB)`` to
    ``results[fmt]`` and ``results[fmt + " load"]``; the checkpoint's bytes."""
    from megatron.checkpointing import torch_dist

    args = _args(os.path.join(workdir, fmt), with_optimizer, fmt)
    shutil.rmtree(args.save, ignore_errors=True)
    saver = torch_dist.TorchDistSaver(args.save, group, torch.device("cpu"))
    with PeakMemory() as memory:
        start = time.perf_counter()
        folder = _save(model, optimizer, args, saver)
        seconds = time.perf_counter() - start
    results.setdefault(fmt, []).append((seconds, memory.gib))
    with PeakMemory() as memory:
        start = time.perf_counter()
        _load(model, optimizer if with_optimizer else None, args, group)
        seconds = time.perf_counter() - start
    results.setdefault(fmt + " load", []).append((seconds, memory.gib))
    return folder_bytes(folder)


def measure(size: dict, with_optimizer: bool, workdir: str, repeats: int = 1) -> list:
    """The rows of one run (see the module docstring), medians of ``repeats`` rounds, each
    round the disk, then each format's save and load in turn (a shared machine drifts: the
    ratios are paired). Needs a world of one."""
    from megatron.checkpointing import torch_dist

    model, optimizer, params = build(size)
    group = torch_dist.checkpoint_group()
    step = TrainStep(model, optimizer, size["vocab"], size["seq"])
    step()  # warm-up
    baseline = statistics.median(step()[0] for _ in range(3))
    results, disks, nbytes = {}, [], {}
    for _ in range(repeats):
        for fmt in ("torch", "torch_dist"):
            nbytes[fmt] = _save_and_load(fmt, model, optimizer, group, workdir, with_optimizer,
                                         results)
        disks.append(disk_write_gbps(workdir, min(nbytes["torch"], 2 << 30)))
    disk = statistics.median(disks)
    rows = [{"benchmark": "dist_checkpoint", "case": "disk sequential write", "GB/s": disk,
             "note": f"{params / 1e9:.2f} B parameters, "
                     f"{'weights + Adam' if with_optimizer else 'weights'}, "
                     f"{nbytes['torch'] / 1e9:.2f} GB per checkpoint (torch_dist "
                     f"{nbytes['torch_dist'] / 1e9:.2f} GB); median of {repeats}: "
                     + ", ".join(f"{d:.3f}" for d in disks)}]
    for case in ("torch", "torch_dist", "torch load", "torch_dist load"):
        fmt = case.split()[0]
        seconds = statistics.median(r[0] for r in results[case])
        gbps = nbytes[fmt] / seconds / 1e9
        rows.append({"benchmark": "dist_checkpoint",
                     "case": f"--ckpt-format {fmt} {'load' if case.endswith('load') else 'save'}",
                     "seconds": seconds, "GB/s": gbps, "of ceiling": gbps / disk,
                     "peak GiB": max(r[1] for r in results[case])})
    rows += _async_stall(model, optimizer, group, workdir, with_optimizer, step, baseline,
                         statistics.median(r[0] for r in results["torch_dist"]))
    torch.distributed.destroy_process_group(group)
    return rows


def _async_stall(model, optimizer, group, workdir, with_optimizer, step, baseline, sync_seconds):
    """The loop's wait for one ``--async-save`` save against the synchronous save's (a save
    blocks the loop for all of its time), and the training steps' slowdown meanwhile."""
    from megatron.checkpointing import torch_dist

    args = _args(os.path.join(workdir, "async"), with_optimizer, "torch_dist", async_save=True)
    saver = torch_dist.TorchDistSaver(args.save, group, torch.device("cpu"), async_save=True)
    with PeakMemory() as memory:
        start = time.perf_counter()
        _save(model, optimizer, args, saver)
        handoff = time.perf_counter() - start
        pending = saver.pending.write
        computes, waited = [], 0.0
        while pending.state() == 0:  # RUNNING: the loop keeps training
            compute, wait = step(before_step=saver.wait_for_staging)
            computes.append(compute)
            waited += wait
        saver.finalize(blocking=True)
    stall = handoff + waited
    slowdown = sum(computes) - baseline * len(computes)
    return [{"benchmark": "dist_checkpoint", "case": "torch_dist save stall, sync",
             "seconds": sync_seconds},
            {"benchmark": "dist_checkpoint", "case": "torch_dist save stall, --async-save",
             "seconds": stall, "ratio": stall / sync_seconds, "peak GiB": memory.gib,
             "note": f"hand-off {handoff:.2f} s + wait for the host copy {waited:.2f} s; copy "
                     f"{pending.staged_seconds:.2f} s, copy and write {pending.seconds:.2f} s"},
            {"benchmark": "dist_checkpoint", "case": "steps during the async write",
             "seconds": slowdown, "ratio": sum(computes) / (baseline * len(computes)),
             "note": f"{len(computes)} forward-backward passes, {slowdown:.2f} s slower in all "
                     f"than at {baseline:.2f} s each"}]


def _world_of_one():
    import datetime

    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.training.initialize import _free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(minutes=30))
    ps.initialize_model_parallel(1, 1)


def run(quick: bool = False, size: str | None = None, with_optimizer: bool = True,
        workdir: str | None = None, repeats: int = 1) -> list:
    """Rows for ``benchmarks/run_all.py`` (quick: the tiny model, which checks the harness)."""
    from tools.checkpoint.convert import return_freed_memory_to_os

    return_freed_memory_to_os()  # freed tensors leave RssAnon, so each peak is its own
    torch.manual_seed(0)
    from megatron.core import parallel_state as ps

    initialized = torch.distributed.is_initialized()
    if not initialized:
        _world_of_one()
    elif not ps.model_parallel_is_initialized():  # a world of one made by the caller
        ps.initialize_model_parallel(1, 1)
    tmp = tempfile.mkdtemp(dir=workdir, prefix="dist_checkpoint_")
    try:
        return measure(SIZES[size or ("tiny" if quick else "small")], with_optimizer, tmp,
                       repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not initialized:
            ps.destroy_model_parallel()
            torch.distributed.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--no-optimizer", action="store_true", help="weights only")
    p.add_argument("--workdir", default=None, help="folder on the disk to measure (default: TMPDIR)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of saves and loads (medians)")
    a = p.parse_args(argv)
    rows = run(size=a.size, with_optimizer=not a.no_optimizer, workdir=a.workdir,
               repeats=a.repeats)
    for r in rows:
        cells = [f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                 if k not in ("benchmark", "case")]
        print(f"{r['case']:<40} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
