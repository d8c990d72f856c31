import torch
from tests.helpers.dist import run_distributed
def f():
    import torch.distributed as dist
    return {"t": torch.ones(3, dtype=torch.bfloat16) * dist.get_rank(), "x": [1.5, (2, "a")]}
def test_tensors_come_back():
    out = run_distributed(2, f)
    assert out[1]["t"].dtype == torch.bfloat16 and out[1]["t"].tolist() == [1.0, 1.0, 1.0]
    assert out[0]["x"] == [1.5, (2, "a")]


def _leave_traces(path):
    """Reads what a fresh rank sees, then changes all of it (as a careless test would)."""
    import os
    import random

    import numpy as np
    import torch.distributed as dist

    import megatron.checkpointing.legacy as ckpt
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_manual_seed
    seen = {"env": os.environ.get("LEFT_BY_A_TASK"), "cwd": os.getcwd(), "torch": torch.rand(2).tolist(),
            "numpy": float(np.random.rand()), "random": random.random(),
            "writer": ckpt.write_atomic.__name__, "groups": ps.model_parallel_is_initialized()}
    os.environ["LEFT_BY_A_TASK"] = "1"
    os.chdir(path)
    torch.manual_seed(123)
    ckpt.write_atomic = None
    ps.initialize_model_parallel(2, 1)
    model_parallel_manual_seed(5, dist.get_rank())
    dist.new_group([0])
    return seen


def _fail_on_rank_1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("rank 1 says no")
    dist.barrier()


def test_a_task_finds_what_a_fresh_world_has_whatever_the_task_before_did(tmp_path):
    fresh = run_distributed(2, _leave_traces, str(tmp_path), fresh=True)
    assert fresh[0]["env"] is None and fresh[0]["writer"] == "write_atomic" and not fresh[0]["groups"]
    first = run_distributed(2, _leave_traces, str(tmp_path))
    second = run_distributed(2, _leave_traces, str(tmp_path))
    assert second == first  # every generator put back too
    # numpy and random are seeded anew in every fresh rank (from the OS), torch is not:
    drop = lambda runs: [{k: v for k, v in r.items() if k not in ("numpy", "random")} for r in runs]
    assert drop(first) == drop(fresh)


def test_a_failing_task_names_its_rank_and_the_next_task_gets_a_working_world():
    import pytest
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*ValueError: rank 1 says no"):
        run_distributed(2, _fail_on_rank_1)
    out = run_distributed(2, f)
    assert out[1]["t"].tolist() == [1.0, 1.0, 1.0]
