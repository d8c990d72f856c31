"""torchrun entry for the reliability tests: ``pretrain_llama.main`` plus injected faults.

Environment (all optional):
    RELIABILITY_OUT: folder; each rank writes ``history_rank{R}.json`` (losses as exact float
        reprs) when training returns, and ``pid_rank{R}`` at start.
    RELIABILITY_FAULT: ``kill@N`` (SIGKILL itself), ``raise@N`` (RuntimeError) or ``hang@N``
        (sleep forever) just before the N-th train step of this process, on rank
        RELIABILITY_FAULT_RANK (default 1), only in the first torchrun attempt
        (TORCHELASTIC_RESTART_COUNT 0), so an elastic restart runs undisturbed.
    RELIABILITY_STEP_DELAY: seconds to sleep before each train step (results unchanged).
    RELIABILITY_WRITE_DELAY: seconds to sleep after each record a distributed checkpoint writes
        (torch.distributed.checkpoint's ``_write_item``), so a test can kill during a write.
"""

import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import pretrain_llama  # noqa: E402
from megatron.training import train  # noqa: E402


def _install_fault(spec: str) -> None:
    kind, at = spec.split("@")
    at = int(at)
    real = train.train_step
    calls = [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "raise":
                raise RuntimeError(f"injected failure before train step {at}")
            if kind == "hang":
                time.sleep(3600)
        return real(*args, **kwargs)

    train.train_step = faulty


def main():
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    rank = int(os.environ.get("RANK", "0"))
    out = os.environ.get("RELIABILITY_OUT")
    if out:
        with open(os.path.join(out, f"pid_rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
    fault = os.environ.get("RELIABILITY_FAULT")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if fault and first_attempt and rank == int(os.environ.get("RELIABILITY_FAULT_RANK", "1")):
        _install_fault(fault)
    delay = float(os.environ.get("RELIABILITY_STEP_DELAY", "0"))
    if delay:  # slow the steps down so a test can act at an iteration it reads in the log
        real = train.train_step

        def slow(*args, **kwargs):
            time.sleep(delay)
            return real(*args, **kwargs)

        train.train_step = slow
    write_delay = float(os.environ.get("RELIABILITY_WRITE_DELAY", "0"))
    if write_delay and first_attempt:
        import torch.distributed.checkpoint.filesystem as fs

        real_write = fs._write_item

        def slow_write(*args, **kwargs):
            result = real_write(*args, **kwargs)
            time.sleep(write_delay)
            return result

        fs._write_item = slow_write
    history = pretrain_llama.main(sys.argv[1:])
    if out:
        keep = {k: history[k] for k in ("iteration", "lm loss", "grad norm", "valid")}
        with open(os.path.join(out, f"history_rank{rank}.json"), "w") as f:
            json.dump(keep, f)  # json writes floats as their shortest exact repr


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
