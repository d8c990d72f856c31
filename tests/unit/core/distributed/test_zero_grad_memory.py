"""ZeRO-2 / ZeRO-3 reduce-scatter every bucket in every micro-batch's backward and keep only
the rank's fp32 gradient shard between micro-batches (Megatron-FSDP's ``optim_grads``,
DeepSpeed's ZeRO-2): on the toy network (4 buckets of 68, 272, 32, 144 elements at DP=2) over an
iteration of 3 micro-batches, with and without ``--overlap-grad-reduce``:

* communication, counted per micro-batch from the collectives issued: each bucket exactly once
  per micro-batch, ``4 Psi_pad`` bytes of fp32 reduce-scattered (a rank sends
  ``(N-1)/N`` of them in a ring), as the bucket's gradients become final; ZeRO-1 nothing before
  the last micro-batch's gradients, each bucket once in the iteration;
* peak gradient bytes per rank, measured from the storages (the full bucket storages and the
  shards, sampled after every gradient hook, and the DDP's own meter of storage sizes):
  ZeRO-1 ``4 Psi_pad``; ZeRO-2 ``4 Psi_pad / N`` + the largest bucket (+ the bucket before it,
  still in flight, under the overlap); ZeRO-3 ``4 Psi_pad / N`` + the units whose backward runs
  at once (the root unit, live from the loss to the input layer, and the norm).
"""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import collectives
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.toy import distrib_batch
from tests.unit.core.distributed.test_zero import _build

NUM_MB = 3
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


def _grad_storage_bytes(ddp):
    """Bytes the gradient storages hold now, read from the storages themselves."""
    mem = ddp.memory_bytes()
    return mem["grads"] + mem["grad_shards"]


def _iteration(strategy, overlap):
    from megatron.core.distributed import finalize_model_grads

    net, ddp, opt = _build(strategy, overlap)
    sampled = []
    for p in net.parameters():  # registered after DDP's hooks: run after them
        p.register_post_accumulate_grad_hook(lambda _p: sampled.append(_grad_storage_bytes(ddp)))
    rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    x, y = distrib_batch(0)
    x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
    ddp.zero_grad_buffer()
    ddp.grad_meter.reset_peak()
    sampled.append(_grad_storage_bytes(ddp))
    per_mb = []
    for i, (xm, ym) in enumerate(zip(x.chunk(NUM_MB), y.chunk(NUM_MB))):
        ctx = ddp.no_sync() if i < NUM_MB - 1 else torch.enable_grad()
        with ctx, collectives.recording() as events:
            torch.nn.functional.mse_loss(ddp(xm), ym).div(NUM_MB).backward()
        per_mb.append([(e["op"], e["bucket"], e["numel"], e["dtype"]) for e in events])
    with collectives.recording() as events:
        finalize_model_grads([ddp], pg_collection=current_groups())
    per_mb.append([(e["op"], e["bucket"], e["numel"], e["dtype"]) for e in events])
    sampled.append(_grad_storage_bytes(ddp))
    opt.step()
    buckets = [b.numel_padded for buf in ddp.buffers for b in buf.buckets]
    units = ([[b.index for b in u.buckets] for u in ddp.param_units.units]
             if ddp.param_units else None)
    return {"per_mb": per_mb, "sampled_peak": max(sampled), "meter_peak": ddp.grad_meter.peak,
            "meter_now": ddp.grad_meter.current, "now": _grad_storage_bytes(ddp),
            "buckets": buckets, "units": units}


def _all():
    ps.initialize_model_parallel(1, 1)
    return {(s, o): _iteration(s, o) for s in STRATEGIES for o in (False, True)}


@pytest.fixture(scope="module")
def measured():
    return run_distributed(2, _all)[0]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reduce_scatter_per_micro_batch(measured, strategy, overlap):
    r = measured[(strategy, overlap)]
    psi_pad = sum(r["buckets"])
    backward, final = r["per_mb"][:NUM_MB], r["per_mb"][NUM_MB]
    rs = lambda evs: [e for e in evs if e[0] == "reduce_scatter"]  # noqa: E731
    if strategy == "optim":
        # ZeRO-1: nothing before the last micro-batch; every bucket once in the iteration
        assert all(rs(evs) == [] for evs in backward[:-1])
        assert sorted(e[1] for e in rs(backward[-1]) + rs(final)) == list(range(4))
        return
    for evs in backward:
        sent = rs(evs)
        assert sorted(e[1] for e in sent) == list(range(len(r["buckets"])))
        assert all(e[3] == torch.float32 for e in sent)
        assert sum(e[2] * 4 for e in sent) == 4 * psi_pad  # bytes per micro-batch
    assert rs(final) == []  # nothing left for finalize_model_grads


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_peak_gradient_bytes_equal_the_formula(measured, strategy, overlap):
    r = measured[(strategy, overlap)]
    n = 2
    sizes = r["buckets"]
    psi_pad = sum(sizes)
    if strategy == "optim":
        formula = 4 * psi_pad
    elif strategy == "optim_grads":
        assert sizes == [68, 272, 32, 144]
        window = (max(a + b for a, b in zip(sizes, sizes[1:])) if overlap else max(sizes))
        formula = 4 * psi_pad // n + 4 * window
    else:
        # units: [root, norm]; root's one bucket lives through the whole backward
        assert r["units"] == [[1], [0]] and sizes == [32, 484]
        formula = 4 * psi_pad // n + 4 * (sizes[0] + sizes[1])
    assert r["sampled_peak"] == formula
    assert r["meter_peak"] == formula
    assert r["meter_now"] == r["now"]
    held = 4 * psi_pad if strategy == "optim" else 4 * psi_pad // n
    assert r["now"] == held  # between iterations: the buffer (ZeRO-1) or the shards
    if strategy == "optim_grads":
        assert formula < 4 * psi_pad + 4 * psi_pad // n  # what it held before (full + shards)
