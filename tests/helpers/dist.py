"""Run a function in a world of N CPU processes (gloo), for tests.

``run_distributed(world_size, fn, *args)`` starts ``world_size`` processes, initializes
``torch.distributed`` with the gloo backend through a file rendezvous, calls ``fn(*args)`` in every
process and returns the list of per-rank results (rank order). ``fn`` must be a module-level
function (it is pickled); it sets up model-parallel groups itself if it needs them. Its result may
hold tensors, numbers, strings and lists / tuples / dicts of them (it is sent back with
``torch.save`` and read with ``weights_only=True``).

A child's exception fails the caller with that child's traceback; a hang fails after ``timeout``
seconds instead of blocking the test run. Children come from a fork server that has imported torch,
its lazily imported distributed modules and the project's entry modules once, so starting a world
costs little.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

_CTX = None

# Imported once by the fork server, so that no rank pays them: torch's lazily imported distributed
# modules (DCP with DTensor and sympy: about 3 s of CPU per rank) and the project's entry modules.
# A module that fails to import here is imported by the rank that needs it, as before.
PRELOAD = ["torch", "torch.distributed", "numpy", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "megatron.core.dist_checkpointing.storage",
           "megatron.training.train", "megatron.checkpointing", "megatron.core.pipeline_parallel",
           "pretrain_llama", "tests.helpers.dist", "tests.helpers.pretrain", "tests.helpers.model"]


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def _child(rank, world_size, init_file, timeout, fn, args, results):
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        out = fn(*args)
        # Tensors travel by value (serialized bytes): a tensor sent through the queue as shared
        # memory can vanish when this process exits before the parent has read it.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(world_size: int, fn, *args, timeout: float = 180.0):
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the per-rank results.

    Raises:
        RuntimeError: with the child's traceback if any rank raised, or if the world did not
            finish within ``timeout`` seconds.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_child, args=(r, world_size, init_file, timeout, fn, args, results),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        out = [None] * world_size
        received = 0
        deadline = time.monotonic() + timeout + 30
        try:
            while received < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(f"distributed test timed out after {timeout:.0f} s "
                                       f"({received}/{world_size} ranks finished)")
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue_mod.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"rank process exited with code {dead[0].exitcode} "
                                           "without reporting")
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                out[rank] = torch.load(io.BytesIO(value), weights_only=True)
                received += 1
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return out
