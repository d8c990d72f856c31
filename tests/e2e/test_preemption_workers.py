"""Preemption and kills with DataLoader workers (issue 31; slow): ``pretrain_llama.py`` under
``torchrun`` with ``--num-workers 2`` (the default), as the reliability runs of
tests/e2e/test_reliability_launch.py but with loader processes beside every rank.

torchrun forwards a SIGTERM it receives to each rank's whole process group, loader workers
included (``os.killpg``); Slurm sends that SIGTERM to the agent on preemption.
"""

import os
import signal
import time

import pytest

from megatron import checkpointing as ckpt
from tests.e2e.test_reliability_launch import TP2, Run
from tests.helpers.reliability import child_processes, process_running, tiny_argv, write_dataset

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")]


def _wait_for_children(pid, count, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        kids = child_processes(pid)
        if len(kids) >= count:
            return kids
        time.sleep(0.1)
    pytest.fail(f"rank pid {pid} has {child_processes(pid)} children, expected {count} loader workers")


def _gone_within(pids, seconds):
    deadline = time.time() + seconds
    while any(map(process_running, pids)) and time.time() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if process_running(pid)]
    for pid in alive:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    return alive


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    prefix = write_dataset(str(root / "text_document"))

    def argv(*extra, iters=200):
        return tiny_argv(prefix, str(root / "cache"), iters, *TP2, "--num-workers", "2", *extra)

    return root, argv


@pytest.mark.parametrize("fmt", [["--ckpt-format", "torch"], ["--ckpt-format", "torch_dist"],
                                 ["--ckpt-format", "torch_dist", "--async-save"]],
                         ids=["torch", "torch_dist", "async"])
def test_sigterm_to_the_agent_with_loader_workers_saves_and_every_rank_returns(data, fmt):
    """Before the fix the workers died of the forwarded SIGTERM and both ranks crashed in their
    next batch ("DataLoader worker ... is killed by signal: Terminated"); nothing was saved."""
    root, argv = data
    name = "_".join(f.strip("-") for f in fmt)
    save = str(root / f"{name}_ckpt")
    run = Run(root / name, argv("--save", save, "--exit-signal-handler", *fmt),
              env={"RELIABILITY_STEP_DELAY": "0.2"})
    run.wait_for(r"iteration\s+3/")
    workers = [w for rank in range(2) for w in _wait_for_children(run.pid(rank), 2)]
    run.proc.send_signal(signal.SIGTERM)  # to the agent, as Slurm on preemption
    run.wait()  # the agent itself reports the signal with a non-zero status
    log = run.log()
    assert os.path.exists(os.path.join(run.out, "history_rank1.json")), log[-3000:]
    last = run.history(1)["iteration"][-1]  # written after main() returned: the rank ended well
    assert run.history(0)["iteration"][-1] == last and 3 <= last < 200
    assert f"exiting program at iteration {last} after receiving SIGTERM" in log
    assert "killed by signal" not in log
    assert open(os.path.join(save, ckpt.TRACKER_FILENAME)).read() == str(last)
    assert os.path.isdir(os.path.join(save, f"iter_{last:07d}"))
    assert not _gone_within(workers, 10)


def test_loader_workers_die_with_a_sigkilled_rank(data):
    """Every process SIGKILLed at once (the agent too, so nobody signals the workers): the
    workers of both ranks must go with them. Before the fix they lived on (the loader's
    watchdog polls every 5 s, and a worker with a batch in its queue's pipe then blocks on
    exit for as long as the pipe stays full)."""
    root, argv = data
    run = Run(root / "killed", argv(), env={"RELIABILITY_STEP_DELAY": "0.2"})
    run.wait_for(r"iteration\s+3/")
    workers = [w for rank in range(2) for w in _wait_for_children(run.pid(rank), 2)]
    run.kill_all()
    run.wait()
    assert not _gone_within(workers, 2), "loader workers outlived their SIGKILLed rank"
