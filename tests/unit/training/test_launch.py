"""megatron/training/launch.py: a rank without a GPU of its own is refused (device count faked on
the CPU), ranks sharing one physical GPU are named through the store, a taken MASTER_PORT is
named, and a worker dies with its torchrun agent (both the prctl and the polling guard)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from megatron.training import initialize, launch
from tests.helpers.paths import ROOT
from tests.helpers.reliability import process_running


def test_local_rank_beyond_the_gpus_or_too_many_processes_is_refused():
    assert launch.check_local_device(3, 4, 4) == 3
    with pytest.raises(ValueError, match=r"^LOCAL_RANK=4 but this process sees 4 GPU\(s\)"):
        launch.check_local_device(4, 4, None)
    with pytest.raises(ValueError, match=r"^LOCAL_WORLD_SIZE=8 processes on this node but it has "
                                         r"4 GPU\(s\): ranks would share a GPU"):
        launch.check_local_device(0, 4, 8)  # refused on every rank, not only the ones above 3


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda as on a machine with two GPUs; set_device calls recorded."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1])
    return chosen


def test_select_device_maps_local_rank_and_refuses_sharing(fake_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert initialize.select_device("nccl") == torch.device("cuda", 1) and fake_gpus == [1]
    monkeypatch.setenv("LOCAL_RANK", "2")  # was cuda:(2 % 2) = cuda:0, shared with rank 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=4 processes on this node"):
        initialize.select_device(None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but this process sees 2 GPU"):
        initialize.select_device(None)
    assert fake_gpus == [1]  # nothing was set for the refused ranks
    assert initialize.select_device("gloo") == torch.device("cpu")


def test_two_ranks_on_one_physical_gpu_are_named():
    store = dist.HashStore()
    launch.check_unique_device(store, 0, "GPU-aaaa", host="node1")
    launch.check_unique_device(store, 1, "GPU-bbbb", host="node1")
    launch.check_unique_device(store, 2, "GPU-aaaa", host="node2")  # same model, other machine
    with pytest.raises(ValueError, match="^rank 3 and rank 0 both compute on GPU GPU-aaaa of node1"):
        launch.check_unique_device(store, 3, "GPU-aaaa", host="node1")


def test_taken_master_port_is_named(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        with pytest.raises(RuntimeError) as err:
            initialize.initialize_distributed("gloo", 0.1)
    assert str(err.value).startswith(f"MASTER_PORT={port} is already in use on 127.0.0.1")
    assert not dist.is_initialized()


_CHILD = """
import os, sys, time
sys.path.insert(0, {root!r})
from megatron.training import launch
print(launch.die_with_agent(poll_seconds=0.1, use_prctl={prctl}), os.getpid(), flush=True)
while True:
    time.sleep(0.05)
"""

# The stand-in agent: starts the worker, reports its pid, then waits to be SIGKILLed.
_AGENT = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(worker.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("prctl", [True, False])
def test_worker_dies_with_its_agent(prctl):
    env = dict(os.environ, TORCHELASTIC_RUN_ID="test")
    agent = subprocess.Popen([sys.executable, "-c", _AGENT, _CHILD.format(root=ROOT, prctl=prctl)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    how, pid = agent.stdout.readline().split()
    assert how == ("prctl" if prctl else "poll") and process_running(int(pid))
    agent.kill()
    agent.wait()
    deadline = time.time() + 10
    while process_running(int(pid)) and time.time() < deadline:
        time.sleep(0.05)
    alive = process_running(int(pid))
    if alive:  # do not leave it behind
        os.kill(int(pid), signal.SIGKILL)
    assert not alive, "the worker outlived its agent"


def test_no_guard_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launch.die_with_agent() is None


def test_one_gpu_per_task_uses_cuda_0_and_says_so(fake_gpus, monkeypatch, capsys):
    """Issue 31: Slurm's --gpus-per-task=1 gives LOCAL_RANK=5 and CUDA_VISIBLE_DEVICES=5, one
    visible GPU; it was refused ("LOCAL_RANK=5 but this process sees 1 GPU(s)")."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    monkeypatch.setenv("RANK", "0")
    assert initialize.select_device("nccl") == torch.device("cuda", 0) and fake_gpus == [0]
    assert ("each process is given one GPU (rank 0: LOCAL_RANK=5, CUDA_VISIBLE_DEVICES=5, as "
            "Slurm's --gpus-per-task=1): every rank computes on its cuda:0") in capsys.readouterr().out
    # Ambiguous: one GPU for the node's 8 processes (no CUDA_VISIBLE_DEVICES), or two named
    # where one is visible: refused as before.
    for visible in (None, "4,5"):
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=8 processes on this node but it "
                                             r"has 1 GPU\(s\)"):
            initialize.select_device("nccl")
    assert fake_gpus == [0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl")
def test_a_loader_worker_ignores_the_launcher_s_signals():
    """Issue 31: torchrun forwards SIGTERM to the rank's process group, loader workers included;
    a worker guarded by guard_loader_worker lives on (the slow tests in
    tests/e2e/test_preemption_workers.py show the whole run saving)."""
    import multiprocessing

    ready = multiprocessing.get_context("fork").Event()

    from megatron.data import loader_workers

    def worker():
        loader_workers.guard_loader_worker()
        ready.set()
        time.sleep(60)

    proc = multiprocessing.get_context("fork").Process(target=worker, daemon=True)
    proc.start()
    try:
        assert ready.wait(30)
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(proc.pid, sig)
        proc.join(1.0)
        assert proc.is_alive(), f"the worker died of a forwarded signal ({proc.exitcode})"
    finally:
        proc.kill()
        proc.join()


_SLOW_HELPER = """
import multiprocessing, os, sys, time
sys.path.insert(0, sys.argv[1])
from megatron.data.loader_workers import die_with_parent

def helper(parent, out):
    while os.getppid() == parent:  # a helper slow to start: its parent is gone first
        time.sleep(0.01)
    die_with_parent(parent_pid=parent)
    with open(out, "w") as f:
        f.write("survived")

if __name__ == "__main__":
    proc = multiprocessing.get_context("fork").Process(target=helper, args=(os.getpid(), sys.argv[2]))
    proc.start()
    with open(sys.argv[3], "w") as f:
        f.write(str(proc.pid))
    os._exit(0)  # the parent dies before the helper has set its guard
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and prctl")
def test_a_helper_whose_parent_died_before_its_guard_was_set_dies_at_the_guard(tmp_path):
    """A preprocessing worker slow to start outlived its SIGKILLed main process (about one run
    in 150 on a loaded machine): it read its parent from os.getppid() when the parent was
    already gone, i.e. the orphans' reaper, and so never noticed. die_with_parent now takes the
    pid the parent had when it started the helper."""
    out, pid_file = tmp_path / "survived", tmp_path / "pid"
    subprocess.run([sys.executable, "-c", _SLOW_HELPER, str(ROOT), str(out), str(pid_file)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=True)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while process_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = process_running(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive and not out.exists(), "the orphaned helper lived on"
