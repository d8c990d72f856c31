"""Run a function in a world of N CPU processes (gloo), for tests.

``run_distributed(world_size, fn, *args)`` runs ``fn(*args)`` on ``world_size`` gloo ranks and
returns the list of per-rank results (rank order). ``fn`` must be a module-level function (it is
pickled); it sets up model-parallel groups itself if it needs them. Its result may hold tensors,
numbers, strings and lists / tuples / dicts of them (it is sent back with ``torch.save`` and read
with ``weights_only=True``).

A child's exception fails the caller with that child's traceback; a hang fails after ``timeout``
seconds instead of blocking the test run.

Warm worlds. Worlds of 1, 2, 4 and 8 ranks are kept for the test session (as Megatron-LM's unit
tests keep one world per session): their ranks initialise the default gloo group once and take
one task after another. Before each task a rank takes the caller's working directory, ``sys.path``
and ``sys.argv`` (what a freshly started rank gets); after it, every rank puts back what a fresh
rank had: environment variables, working directory, ``sys.path``, ``sys.argv``, the torch / numpy /
``random`` generator states, the model-parallel RNG tracker, default dtype, grad mode, thread
count, deterministic-algorithms flag, warnings filters, signal handlers and the module-level names
of the project's modules (a task that replaces ``ckpt.write_atomic`` leaves no trace). It forgets
the model-parallel groups (``destroy_model_parallel``) and destroys every process group the task
made except the default one; ``new_group`` is collective, so the ranks first check over the
default group that they made the same number of groups. A world whose task failed, timed out, left
a thread or a child process running, destroyed the default group or disagrees on its groups is
torn down, as is one whose tasks left more than ``_MAX_LEAKED_GLOO_THREADS`` threads of gloo
running (process groups destroyed but still referenced: their loops slow every later task); the
next task gets a fresh one. ``MEGATRON_TEST_POOL_DEBUG=1`` prints each new and renewed world, why,
and the test whose task it last ran. ``fresh=True`` (tests that kill or hang ranks on
purpose) or ``MEGATRON_TEST_FRESH_WORLDS=1`` (all tests) starts a world of new processes for the
one call, as before. ``shutdown_pool()`` ends every warm world (the suite's ``conftest`` calls it
at session end; ``atexit`` too).

Ranks come from a fork server that has imported torch, its lazily imported distributed modules
and the project's entry modules once, so starting a world costs little.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as wait_any
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp

_CTX = None

# Imported once by the fork server, so that no rank pays them: torch's lazily imported distributed
# modules (DCP with DTensor and sympy: about 3 s of CPU per rank; torch._dynamo, which a rank's
# first torch.optim optimizer imports: 1.3 s more) and the project's entry modules.
# A module that fails to import here is imported by the rank that needs it, as before.
PRELOAD = ["torch", "torch.distributed", "numpy", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "torch._dynamo", "megatron.core.dist_checkpointing.storage",
           "megatron.training.train", "megatron.checkpointing", "megatron.core.pipeline_parallel",
           "pretrain_llama", "tests.helpers.dist", "tests.helpers.pretrain", "tests.helpers.model"]

POOLED_SIZES = (1, 2, 4, 8)
MAX_WARM_RANKS = 8          # at most this many idle ranks are kept (least recently used go first)
MAX_TASKS_PER_WORLD = 200   # a world is renewed after this many tasks (bounds its store and heap)
_WORLD_PG_TIMEOUT_S = 1800  # the warm default group's timeout; each call's own timeout is the caller's
_START_TIMEOUT_S = 300      # a new warm world must have initialised its group within this
# Threads of leaked gloo groups a world tolerates before it is renewed (a group runs 3 to 5; each
# 4-rank MoE ZeRO-3 run's model, when DDP's hooks kept it alive, held 12 per rank: after 6 runs
# the idle world used 0.27 s of CPU per 3 s against 0.09 after one).
_MAX_LEAKED_GLOO_THREADS = 30
_SETTLE_TIMEOUT_S = 120     # after a task, its ranks must have cleaned up within this
# Modules whose module-level names a task may rebind (monkeypatching in a rank): put back after each.
_RESTORED_MODULES = ("megatron", "tools", "pretrain_llama", "finetune_llama", "tests", "os",
                     "os.path", "shutil", "subprocess", "signal", "resource", "socket",
                     "tempfile", "random", "time", "builtins", "numpy", "torch",
                     "torch.distributed")


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def _set_rank_env(rank, world_size):
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)


def _serialize(out) -> bytes:
    # Tensors travel by value (serialized bytes): a tensor sent as shared memory can vanish when
    # the sending process exits before the parent has read it.
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


# A world of new processes for one call --------------------------------------------------------

def _child(rank, world_size, init_file, timeout, fn, args, results):
    _set_rank_env(rank, world_size)
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        results.put((rank, True, _serialize(fn(*args))))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_fresh(world_size, fn, args, timeout):
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
                    raise RuntimeError(_timed_out(timeout, received, world_size))
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue_mod.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(_died(dead[0].exitcode))
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


def _timed_out(timeout, received, world_size):
    return f"distributed test timed out after {timeout:.0f} s ({received}/{world_size} ranks finished)"


def _died(exitcode):
    return f"rank process exited with code {exitcode} without reporting"


# A warm world: the rank's side ---------------------------------------------------------------------

class _FreshState:
    """What a freshly started rank has, taken once after its group is up; :meth:`restore` puts it
    back after each task."""

    def __init__(self):
        import random
        import signal
        import sys
        import threading
        import warnings

        import numpy as np

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.sys_path = list(sys.path)
        self.sys_argv = list(sys.argv)
        self.torch_rng = torch.get_rng_state()
        self.numpy_rng = np.random.get_state()
        self.random_rng = random.getstate()
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.threads = torch.get_num_threads()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.warnings = list(warnings.filters)
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                                         signal.SIGUSR2, signal.SIGALRM)}
        self.thread_ids = {t.ident for t in threading.enumerate()}
        self.gloo_threads = gloo_threads()
        self.modules = {}
        self.snapshot_new_modules()

    def snapshot_new_modules(self):
        """Remember the names of project modules not seen before (as imported, before any task
        touched them: called right after a task's function was unpickled)."""
        import sys

        for name, module in list(sys.modules.items()):
            if name in self.modules or module is None:
                continue
            if name in _RESTORED_MODULES or name.split(".")[0] in ("megatron", "tools", "tests",
                                                                   "pretrain_llama",
                                                                   "finetune_llama"):
                self.modules[name] = (module, dict(vars(module)))

    def leftovers(self):
        """Why this rank cannot take another task (a thread or child process the task left
        running), or None."""
        import multiprocessing
        import threading

        extra = [t.name for t in threading.enumerate() if t.ident not in self.thread_ids and t.is_alive()]
        if extra:
            return f"threads left running: {extra}"
        if multiprocessing.active_children():
            return "child processes left running"
        return None

    def restore(self):
        import random
        import signal
        import sys
        import warnings

        import numpy as np

        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import get_rng_tracker

        for module, names in self.modules.values():
            current = vars(module)
            for key, value in names.items():
                if current.get(key, _MISSING) is not value:
                    current[key] = value
        parallel_state.destroy_model_parallel()
        get_rng_tracker().reset()
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        sys.argv[:] = self.sys_argv
        torch.set_rng_state(self.torch_rng)
        np.random.set_state(self.numpy_rng)
        random.setstate(self.random_rng)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        torch.set_num_threads(self.threads)
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != self.deterministic:
            # Only when changed: the first call imports torch's compiler configuration (seconds).
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        warnings.filters[:] = self.warnings
        for sig, handler in self.signals.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)


_MISSING = object()


def gloo_threads() -> int:
    """Threads of this process that gloo's process groups run (0 where /proc is not there)."""
    count = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    count += "gloo" in f.read()
            except OSError:  # the thread ended meanwhile
                pass
    except OSError:
        return 0
    return count


def _settle(state) -> str | None:
    """After a task that returned on every rank: check the ranks agree on their groups, destroy
    every group but the default one, put back the fresh state. Returns why the world cannot go
    on, or None."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return "the task destroyed the default process group"
    why = state.leftovers()
    mine = torch.tensor([c10d._world.group_count, int(why is None)], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)  # also the barrier: no rank still talks on a group destroyed below
    for pg in list(c10d._world.pg_map):
        if pg is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(pg)
    state.restore()
    gc.collect()
    leaked = gloo_threads() - state.gloo_threads
    if why is None and leaked > _MAX_LEAKED_GLOO_THREADS:
        # gloo's loops of process groups that tasks made and something still holds (destroying
        # a group only forgets it): each one left behind slows every later task of this world.
        why = (f"{leaked} threads of gloo left running by process groups that ended tasks made "
               "and something still references")
    clean = torch.tensor([int(why is None)], dtype=torch.int64)
    every_clean = [torch.zeros_like(clean) for _ in range(dist.get_world_size())]
    dist.all_gather(every_clean, clean)
    if why is None and (any(int(e[1]) == 0 for e in every) or any(int(e[0]) == 0 for e in every_clean)):
        why = "another rank left something running"
    if why is None and len({int(e[0]) for e in every}) > 1:
        why = f"the ranks made different numbers of process groups: {[int(e[0]) for e in every]}"
    return why


def _serve(rank, world_size, init_file, conn):
    """A warm rank: initialise the default group, then run tasks from ``conn`` until told to stop
    (None) or the parent goes away. Messages back: ("ready",), ("result", ok, payload),
    ("settled", why-not-or-None)."""
    _set_rank_env(rank, world_size)
    import sys

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=_WORLD_PG_TIMEOUT_S))
    # What the fork server preloaded lives as long as the rank: out of the collector's scans,
    # the collection after each task takes microseconds, not 0.13 s.
    gc.freeze()
    state = _FreshState()
    conn.send(("ready",))
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            break
        try:
            task = ForkingPickler.loads(raw)  # imports the test's module, as a new rank would
            if task is None:
                break
            fn, args, cwd, sys_path, sys_argv = task
            state.snapshot_new_modules()
            os.chdir(cwd)
            sys.path[:] = sys_path
            sys.argv[:] = sys_argv
            payload, ok = _serialize(fn(*args)), True
        except BaseException:  # report everything, including SystemExit, to the parent
            payload, ok = traceback.format_exc(), False
        conn.send(("result", ok, payload))
        if not ok:
            break  # the parent tears this world down
        try:
            why = _settle(state)
        except BaseException:
            why = "cleanup failed:\n" + traceback.format_exc()
        conn.send(("settled", why))
        if why is not None:
            break
    conn.close()
    os._exit(0)  # the parent destroys nothing of ours; gloo's sockets close with the process


# A warm world: the caller's side -------------------------------------------------------------------

class _World:
    def __init__(self, world_size):
        ctx = _context()
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix="warm_world_")
        init_file = os.path.join(self.tmp, "rendezvous")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world_size, init_file, theirs), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self.tasks = 0
        self.ready = False
        self.unsettled = False

    def _receive(self, expected, deadline, on_timeout):
        """One message of kind ``expected`` from every rank, by ``deadline``; raises on a rank's
        failure, death or the deadline (the world is then unusable)."""
        got = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(on_timeout(self.world_size - len(pending)))
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            for ready in wait_any(waitables, timeout=min(remaining, 1.0)):
                rank = next((r for r in pending if ready in (self.conns[r], self.procs[r].sentinel)), None)
                if rank is None:
                    continue
                try:
                    msg = self.conns[rank].recv() if self.conns[rank].poll() else None
                except (EOFError, OSError):
                    msg = None
                if msg is None:
                    if self.procs[rank].is_alive():
                        continue
                    self.procs[rank].join(timeout=1)
                    raise RuntimeError(_died(self.procs[rank].exitcode))
                if msg[0] != expected:
                    raise RuntimeError(f"warm world: rank {rank} sent {msg[0]!r}, not {expected!r}")
                if expected == "result" and not msg[1]:
                    raise RuntimeError(f"rank {rank} failed:\n{msg[2]}")
                got[rank] = msg
                pending.discard(rank)
        return got

    def _settle(self):
        """Wait for the previous task's cleanup; False when the world cannot take another."""
        if not self.unsettled:
            return True
        self.unsettled = False
        try:
            msgs = self._receive("settled", time.monotonic() + _SETTLE_TIMEOUT_S,
                                 lambda n: "warm world did not settle")
        except RuntimeError as e:
            self.why = str(e)
            return False
        self.why = [m[1] for m in msgs if m[1] is not None]
        return not self.why

    why = None
    last_test = None

    def usable(self):
        if self.tasks >= MAX_TASKS_PER_WORLD:
            self.why = f"{self.tasks} tasks"
            return False
        if not self._settle():  # first: reads why the ranks ended, if they did
            return False
        if not all(p.is_alive() for p in self.procs):
            self.why = f"ranks ended: exit codes {[p.exitcode for p in self.procs]}"
            return False
        return True

    def run(self, fn, args, timeout):
        deadline = time.monotonic() + timeout + 30
        if not self.ready:
            self._receive("ready", time.monotonic() + _START_TIMEOUT_S,
                          lambda n: f"warm world of {self.world_size} did not start "
                                    f"({n}/{self.world_size} ranks ready)")
            self.ready = True
        import sys

        task = (fn, args, os.getcwd(), list(sys.path), list(sys.argv))
        self.last_test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        for conn in self.conns:
            conn.send(task)
        self.tasks += 1
        msgs = self._receive("result", deadline,
                             lambda n: _timed_out(timeout, n, self.world_size))
        self.unsettled = True
        return [torch.load(io.BytesIO(m[2]), weights_only=True) for m in msgs]

    def close(self, kill=False):
        if not kill:
            self._settle()
            for conn in self.conns:
                try:
                    conn.send(None)
                except (OSError, ValueError):
                    pass
        for proc in self.procs:
            if kill:
                proc.kill()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


_POOL: dict = {}  # world size -> _World, most recently used last


def _warm_world(world_size) -> _World:
    world = _POOL.pop(world_size, None)
    if world is not None and not world.usable():
        _debug(f"world of {world_size} renewed after {world.tasks} tasks, the last from "
               f"{world.last_test}: {world.why}")
        world.close(kill=True)
        world = None
    if world is None:
        _debug(f"new world of {world_size}")
        while _POOL and sum(_POOL.keys()) + world_size > MAX_WARM_RANKS:
            _POOL.pop(next(iter(_POOL))).close()
        world = _World(world_size)
    _POOL[world_size] = world
    return world


def _debug(line):
    if os.environ.get("MEGATRON_TEST_POOL_DEBUG") == "1":
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        print(f"[run_distributed] {line} ({test})", flush=True)


def shutdown_pool():
    """End every warm world (their ranks exit; nothing is left running)."""
    while _POOL:
        _, world = _POOL.popitem()
        world.close()


atexit.register(shutdown_pool)


def run_distributed(world_size: int, fn, *args, timeout: float = 180.0, fresh: bool = False):
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fresh=True`` runs it in a world of new processes (for tests that kill or hang ranks);
    otherwise worlds of 1, 2, 4 or 8 ranks are warm ones kept for the session (module docstring).

    Raises:
        RuntimeError: with the child's traceback if any rank raised, or if the world did not
            finish within ``timeout`` seconds.
    """
    if (fresh or world_size not in POOLED_SIZES
            or os.environ.get("MEGATRON_TEST_FRESH_WORLDS") == "1"):
        return _run_fresh(world_size, fn, args, timeout)
    world = _warm_world(world_size)
    try:
        return world.run(fn, args, timeout)
    except BaseException:
        _POOL.pop(world_size, None)
        world.close(kill=True)
        raise
