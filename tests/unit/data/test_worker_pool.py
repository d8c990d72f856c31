"""The preprocessing worker pool (``megatron/data/worker_pool.py``): results in input order, and a
worker that dies or stays stopped ends the wait with one line naming it, leaving no process.

Before the pool, ``tools/preprocess_sft_data.py --workers 2`` waited forever for the chunk of a
SIGKILLed worker (``multiprocessing.Pool``), and both tools waited forever for a SIGSTOPped one."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron.data.worker_pool import WorkerDied, WorkerPool, process_state

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")


def _square_late(x):
    time.sleep(0.05 * (4 - x))  # the first items finish last
    return x * x


def _kill_self_at(x, at):
    if x == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def _stop_self_at(x, at):
    if x == at:
        os.kill(os.getpid(), signal.SIGSTOP)
    return x


def _gone(pool):
    deadline = time.time() + 10
    while time.time() < deadline:
        if all(process_state(p.pid) in (None, "Z") for p in pool.processes):
            return True
        time.sleep(0.05)
    return False


def test_results_come_in_input_order_with_a_bounded_window():
    pool = WorkerPool(2)
    try:
        assert list(pool.ordered(_square_late, [(x,) for x in range(5)], window=3)) == [0, 1, 4, 9, 16]
    finally:
        pool.close()
    assert _gone(pool)


def test_a_killed_worker_ends_the_wait_naming_it():
    pool = WorkerPool(2, what="tokenizer worker", advice="rerun")
    with pytest.raises(WorkerDied, match=r"^tokenizer worker \(pid \d+\) was killed by SIGKILL "
                                         r"\(the out-of-memory killer.*no output written; rerun$"):
        list(pool.ordered(_kill_self_at, [(x, 3) for x in range(8)], window=4))
    pool.terminate()
    assert _gone(pool)


def test_a_stopped_worker_ends_the_wait_after_the_limit_naming_it():
    pool = WorkerPool(2, what="tokenizer worker", stopped_limit_s=1.0)
    start = time.monotonic()
    with pytest.raises(WorkerDied, match=r"^tokenizer worker \(pid \d+\) has been stopped "
                                         r"\(SIGSTOP or a debugger\) for \d+ s"):
        list(pool.ordered(_stop_self_at, [(x, 2) for x in range(6)], window=2))
    assert time.monotonic() - start < 30
    pool.terminate()
    assert _gone(pool), "a stopped worker survived the pool"


def test_process_state_reads_a_stopped_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.time() + 10
        while process_state(proc.pid) != "T" and time.time() < deadline:
            time.sleep(0.02)
        assert process_state(proc.pid) == "T"
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.time() + 10
        while process_state(proc.pid) == "T" and time.time() < deadline:
            time.sleep(0.02)
        # Running again: any state but stopped. A resumed process may be in D (disk sleep) while
        # the loaded machine pages its interpreter back in; CI saw that once.
        assert process_state(proc.pid) in ("R", "S", "D")
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid) is None
