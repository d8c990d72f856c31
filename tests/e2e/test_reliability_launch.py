"""Reliability (issue 7), the launched part (slow): ``pretrain_llama.py`` under ``torchrun`` in
CPU processes, killed, signalled, restarted, split over two "nodes", or stuck.

Every run trains the same two-layer LLaMA at TP=2 (dropout on, so the RNG states matter; an
evaluation every 3 iterations, so the validation stream position matters) through
tests/helpers/reliability_entry.py, which writes each rank's losses as exact floats and injects faults.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from megatron import checkpointing as ckpt
from tests.helpers.reliability import process_running, tiny_argv, write_dataset

pytestmark = pytest.mark.slow

from tests.helpers.paths import ROOT
ITERS = 10
TP2 = ["--tensor-model-parallel-size", "2", "--eval-interval", "3"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One ``torchrun`` launch of the entry script; output in ``out/log``."""

    def __init__(self, out, argv, nproc=2, env=None, torchrun=None):
        self.out = str(out)
        os.makedirs(self.out, exist_ok=True)
        launcher = torchrun or ["--standalone"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *launcher,
               "--nproc-per-node", str(nproc), os.path.join(ROOT, "tests", "helpers", "reliability_entry.py"),
               *argv]
        full_env = dict(os.environ, RELIABILITY_OUT=self.out, OMP_NUM_THREADS="1",
                        PYTHONUNBUFFERED="1", **(env or {}))
        self.log_path = os.path.join(self.out, "log")
        self.started = time.time()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_for(self, pattern, timeout=240):
        """Block until ``pattern`` appears in the log (fails if the run ends first)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if re.search(pattern, self.log()):
                return
            if self.proc.poll() is not None:
                pytest.fail(f"run ended before {pattern!r}:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        pytest.fail(f"{pattern!r} not seen in {timeout} s:\n{self.log()[-3000:]}")

    def wait(self, timeout=300):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"run did not end in {timeout} s:\n{self.log()[-3000:]}")
        self.seconds = time.time() - self.started
        return rc

    def kill_all(self, nproc=2):
        """SIGKILL every rank and the agent at once (torchrun starts each rank in a session of
        its own, so the agent's process group does not hold them)."""
        for rank in range(nproc):
            os.kill(self.pid(rank), signal.SIGKILL)
        os.killpg(self.proc.pid, signal.SIGKILL)

    def history(self, rank):
        with open(os.path.join(self.out, f"history_rank{rank}.json")) as f:
            return json.load(f)

    def pid(self, rank):
        with open(os.path.join(self.out, f"pid_rank{rank}")) as f:
            return int(f.read())


def _losses_from(history, first_iteration):
    return {it: loss for it, loss in zip(history["iteration"], history["lm loss"])
            if it >= first_iteration}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    prefix = write_dataset(str(root / "text_document"))
    cache = str(root / "cache")

    def argv(*extra, iters=ITERS):
        return tiny_argv(prefix, cache, iters, *TP2, *extra)

    # The undisturbed reference (also builds the dataset cache the other runs reuse).
    ref = Run(root / "reference", argv())
    assert ref.wait() == 0, ref.log()[-3000:]
    return root, argv, ref.history(1)


def test_sigkill_everything_then_resume_is_bitwise_identical(setup):
    root, argv, reference = setup
    save = str(root / "killed_ckpt")
    flags = ["--save", save, "--load", save, "--save-interval", "2", "--keep-last-checkpoints", "2"]
    run = Run(root / "killed", argv(*flags), env={"RELIABILITY_STEP_DELAY": "0.4"})
    run.wait_for(r"iteration\s+5/")
    run.kill_all()
    run.wait()
    resumed_from = int(open(os.path.join(save, ckpt.TRACKER_FILENAME)).read())
    assert 4 <= resumed_from < ITERS
    again = Run(root / "resumed", argv(*flags))
    assert again.wait() == 0, again.log()[-3000:]
    history = again.history(1)
    assert history["iteration"] == list(range(resumed_from + 1, ITERS + 1))
    assert _losses_from(history, resumed_from + 1) == _losses_from(reference, resumed_from + 1)
    assert history["grad norm"] == reference["grad norm"][resumed_from:]
    # The validation stream continued where it stopped, not from its start.
    assert history["valid"] == [v for v in reference["valid"] if v[0] > resumed_from]
    assert len(ckpt.complete_checkpoints(save)) == 2  # --keep-last-checkpoints 2


def test_sigkill_during_an_async_torch_dist_write_keeps_the_previous_checkpoint(setup):
    """--async-save: every process killed while the background writer is in the middle of the
    second checkpoint; the first stays published and complete, the half-written one is never
    read, and the restart resumes from the first with the undisturbed run's losses (dropout
    on: RNG states restored too)."""
    from megatron.checkpointing import torch_dist

    root, argv, reference = setup
    save = str(root / "async_ckpt")
    flags = ["--save", save, "--load", save, "--save-interval", "3", "--ckpt-format",
             "torch_dist", "--async-save"]
    run = Run(root / "async_killed", argv(*flags), env={"RELIABILITY_WRITE_DELAY": "0.3"})
    staged = os.path.join(save, "iter_0000006.tmp")
    deadline = time.time() + 240
    while not (os.path.isdir(staged) and any(f.endswith(".distcp") for f in os.listdir(staged))):
        assert time.time() < deadline and run.proc.poll() is None, run.log()[-3000:]
        time.sleep(0.05)
    run.kill_all()
    run.wait()
    assert ckpt.find_checkpoint(save) == (3, False)
    assert torch_dist.looks_complete(os.path.join(save, "iter_0000003"))
    assert not torch_dist.looks_complete(staged)  # half written: no .metadata yet
    again = Run(root / "async_resumed", argv(*flags))
    assert again.wait() == 0, again.log()[-3000:]
    history = again.history(1)
    assert history["iteration"] == list(range(4, ITERS + 1))
    assert _losses_from(history, 4) == _losses_from(reference, 4)
    assert history["grad norm"] == reference["grad norm"][3:]
    assert not os.path.exists(staged) and ckpt.find_checkpoint(save) == (ITERS, False)


def test_elastic_restart_after_a_rank_dies_finishes_with_the_same_losses(setup):
    root, argv, reference = setup
    save = str(root / "elastic_ckpt")
    run = Run(root / "elastic", argv("--save", save, "--load", save, "--save-interval", "2"),
              env={"RELIABILITY_FAULT": "kill@5", "RELIABILITY_FAULT_RANK": "1"},
              torchrun=["--standalone", "--max-restarts", "3", "--monitor-interval", "0.2"])
    assert run.wait() == 0, run.log()[-3000:]
    log = run.log()
    # Rank 1 died by SIGKILL, then the agent restarted both ranks, which resumed from iteration 4.
    assert re.search(r"failed \(exitcode: -9\) local_rank: 1", log), log[-3000:]
    assert "loaded checkpoint from" in log.split("exitcode: -9")[1]
    history = run.history(1)  # of the second attempt, resumed from iteration 4
    assert history["iteration"] == list(range(5, ITERS + 1))
    assert history["lm loss"] == reference["lm loss"][4:]
    assert history["valid"] == [v for v in reference["valid"] if v[0] > 4]


def test_sigterm_to_one_rank_makes_every_rank_save_and_exit_0(setup):
    root, argv, _ = setup
    save = str(root / "sigterm_ckpt")
    run = Run(root / "sigterm", argv("--save", save, "--exit-signal-handler", iters=200),
              env={"RELIABILITY_STEP_DELAY": "0.2"})
    run.wait_for(r"iteration\s+3/")
    os.kill(run.pid(1), signal.SIGTERM)  # one rank only: the all-reduce tells the other
    assert run.wait() == 0, run.log()[-3000:]
    last = run.history(0)["iteration"][-1]
    assert run.history(1)["iteration"][-1] == last and 3 <= last < 200
    assert f"exiting program at iteration {last} after receiving SIGTERM" in run.log()
    assert open(os.path.join(save, ckpt.TRACKER_FILENAME)).read() == str(last)


def test_two_nodes_of_two_equal_one_node_of_four(setup):
    root, argv, _ = setup
    one = Run(root / "one_node", argv(iters=4), nproc=4)
    assert one.wait() == 0, one.log()[-3000:]
    port = _port()
    nodes = [Run(root / f"node{i}", argv(iters=4), nproc=2, torchrun=[
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "reliability"]) for i in range(2)]
    for node in nodes:
        assert node.wait() == 0, node.log()[-3000:]
    last = [n for n in nodes if os.path.exists(os.path.join(n.out, "history_rank3.json"))]
    assert len(last) == 1  # global ranks 0..3 over the two agents
    assert last[0].history(3)["lm loss"] == one.history(3)["lm loss"]


def test_a_rank_that_raises_brings_the_job_down_with_its_error(setup):
    root, argv, _ = setup
    run = Run(root / "raises", argv(), env={"RELIABILITY_FAULT": "raise@3"})
    assert run.wait(timeout=120) != 0
    log = run.log()
    assert "RuntimeError: injected failure before train step 3" in log
    assert re.search(r"rank\s*:\s*1", log), log[-3000:]  # torchrun's root-cause summary
    assert run.seconds < 90


def test_a_stuck_collective_fails_after_the_timeout_naming_rank_and_operation(setup):
    root, argv, _ = setup
    run = Run(root / "hangs", argv("--distributed-timeout-minutes", "0.1"),
              env={"RELIABILITY_FAULT": "hang@3"})
    assert run.wait(timeout=180) != 0
    log = run.log()
    assert re.search(r"CollectiveTimeoutError: rank 0: a collective in the train step of "
                     r"iteration 3 did not complete within --distributed-timeout-minutes 0.1 "
                     r"\(6 s\)", log), log[-3000:]


def test_sigterm_to_the_agent_as_on_preemption_still_saves(setup):
    """Slurm preemption signals torchrun's agent, which forwards SIGTERM to every rank and gives
    them time to finish before SIGKILL; the ranks save the iteration they were in."""
    root, argv, _ = setup
    save = str(root / "preempted_ckpt")
    run = Run(root / "preempted", argv("--save", save, "--exit-signal-handler", iters=200),
              env={"RELIABILITY_STEP_DELAY": "0.2"})
    run.wait_for(r"iteration\s+3/")
    run.proc.send_signal(signal.SIGTERM)
    run.wait()  # the agent itself reports the signal with a non-zero status
    last = run.history(1)["iteration"][-1]
    assert run.history(0)["iteration"][-1] == last and 3 <= last < 200
    assert f"exiting program at iteration {last} after receiving SIGTERM" in run.log()
    assert open(os.path.join(save, ckpt.TRACKER_FILENAME)).read() == str(last)


def _published(save):
    tracker = os.path.join(save, ckpt.TRACKER_FILENAME)
    return open(tracker).read(), ckpt.complete_checkpoints(save)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_workers_die_with_a_sigkilled_agent_and_save_nothing_more(setup):
    root, argv, _ = setup
    save = str(root / "orphan_ckpt")
    run = Run(root / "orphan", argv("--save", save, "--save-interval", "2", iters=200),
              env={"RELIABILITY_STEP_DELAY": "0.2"})
    run.wait_for(r"iteration\s+5/")
    pids = [run.pid(rank) for rank in range(2)]
    before = _published(save)
    os.kill(run.proc.pid, signal.SIGKILL)  # the agent only: the workers live in their own sessions
    run.proc.wait()
    killed = time.time()
    while any(map(process_running, pids)) and time.time() - killed < 10:
        time.sleep(0.05)
    alive = [pid for pid in pids if process_running(pid)]
    for pid in alive:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their agent:\n{run.log()[-2000:]}"
    time.sleep(2)  # a worker that lived on would have saved iteration 6 or 8 by now
    assert _published(save) == before
