"""Model-parallel RNG tracker, seeding and activation recompute (checkpoint) on CPU and CUDA."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import (checkpoint, get_rng_tracker, model_parallel_manual_seed)
from megatron.core.tensor_parallel.random import RNGStatesTracker
from tests.helpers.dist import run_distributed

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_seed_fork_and_states(device):
    model_parallel_manual_seed(7, 0)
    tracker = get_rng_tracker()
    a = torch.rand(3, device=device)
    with tracker.fork():
        b1 = torch.rand(3, device=device)
    c = torch.rand(3, device=device)
    states = tracker.get_states()
    with tracker.fork():
        b2 = torch.rand(3, device=device)

    torch.manual_seed(7)  # the default generator is seeded with `seed` and not advanced by fork
    assert torch.equal(torch.rand(6, device=device), torch.cat([a, c]))
    torch.manual_seed(7 + 2718)  # the tracker state: seed + 2718 + tensor-parallel rank (0)
    assert torch.equal(torch.rand(6, device=device), torch.cat([b1, b2]))

    tracker.set_states(states)  # rewinding the tracker replays its numbers
    with tracker.fork():
        assert torch.equal(torch.rand(3, device=device), b2)


def test_tracker_errors_and_restore_on_exception():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a'"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="model_parallel_manual_seed"):
        with tracker.fork("missing"):
            pass
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    with pytest.raises(RuntimeError):
        with tracker.fork("a"):
            torch.rand(5)
            raise RuntimeError("boom")
    assert torch.equal(torch.rand(2), expected)  # default generator restored


class _Block(torch.nn.Module):
    """Linear -> dropout (default generator) -> linear -> dropout (tracker, as in TP regions)."""

    def __init__(self, device):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, device=device)
        self.fc2 = torch.nn.Linear(16, 8, device=device)

    def forward(self, x, scale):
        h = torch.nn.functional.dropout(self.fc1(x), 0.5, training=True)
        with get_rng_tracker().fork():
            h = torch.nn.functional.dropout(self.fc2(h), 0.5, training=True)
        return h * scale


def _grads_and_rng(block, x, recompute, distribute=False, tp_rank=0, tp_group=None):
    model_parallel_manual_seed(11, tp_rank)
    block.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    if recompute:
        out = checkpoint(block, distribute, x, 2.0, tp_group=tp_group)
    else:
        out = block(x, 2.0)
    torch.rand(1, device=x.device)  # advance the generator between forward and backward
    (out * torch.arange(out.numel(), device=x.device).view_as(out)).sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in block.parameters()]
    return out.detach(), grads, torch.rand(4, device=x.device)


def _assert_recompute_equal(device, distribute=False, tp=None):
    tp_rank, tp_group = (0, None) if tp is None else (tp.rank, tp.group)
    torch.manual_seed(0)
    block = _Block(device)
    x = torch.randn(4, 2, 8, device=device)
    out_ref, grads_ref, after_ref = _grads_and_rng(block, x, recompute=False, tp_rank=tp_rank)
    out, grads, after = _grads_and_rng(block, x, recompute=True, distribute=distribute,
                                       tp_rank=tp_rank, tp_group=tp_group)
    assert torch.equal(out, out_ref)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
    assert torch.equal(after, after_ref), "recompute must leave the generators as without it"


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_replays_dropout(device):
    _assert_recompute_equal(device)


def _random_world():
    tp = ps.initialize_model_parallel(2, 1).tp
    model_parallel_manual_seed(5, tp.rank)
    default = torch.rand(4)
    with get_rng_tracker().fork():
        tensor_parallel = torch.rand(4)
    _assert_recompute_equal("cpu", distribute=True, tp=tp)
    return dist.get_rank(), default, tensor_parallel


def test_tensor_parallel_ranks_and_distributed_saved_activations():
    out = run_distributed(2, _random_world)
    (_, d0, t0), (_, d1, t1) = out
    assert torch.equal(d0, d1), "default generator must be equal across tensor-parallel ranks"
    assert not torch.equal(t0, t1), "tracker state must differ across tensor-parallel ranks"
    torch.manual_seed(5 + 2718 + 1)
    assert torch.equal(torch.rand(4), t1)
