"""ZeRO-3 (``optim_grads_params``): a parameter read between iterations, when its full storage
is freed, raises ``ShardedParameterAccessError`` naming the parameter and
``finish_param_sync()`` instead of reading freed memory (which crashed the process with
SIGSEGV); metadata stays readable; after ``finish_param_sync()`` the read gives the gathered
value, equal to the distributed optimizer's; training goes on. Run in gloo worker processes: a
crash would surface as a rank that exited without reporting."""

import pytest
import torch

from megatron.core import parallel_state as ps
from tests.helpers.dist import run_distributed
from tests.helpers.toy import distrib_iteration
from tests.unit.core.distributed.test_zero import _build

READS = {
    "sum": lambda p: p.sum(),
    "print": lambda p: repr(p),
    "tolist": lambda p: p.tolist(),
    ".data": lambda p: p.data,
    "detach": lambda p: p.detach(),
    "add": lambda p: p + 1,
    "cat": lambda p: torch.cat([p, p]),
    "clone": lambda p: p.clone(),
    "index": lambda p: p[0, 0].item(),
    "as_subclass": lambda p: p.as_subclass(torch.Tensor).sum(),  # not routed to __torch_function__
}


def _read_between_iterations():
    from megatron.core.distributed.param_units import ShardedParameterAccessError

    ps.initialize_model_parallel(1, 1)
    out = {}
    net, ddp, opt = _build("optim_grads_params", overlap_grad=True)
    ref_net, ref_ddp, ref_opt = _build("optim", overlap_grad=True)
    for step in range(2):
        distrib_iteration(ddp, opt, step, 2)
        distrib_iteration(ref_ddp, ref_opt, step, 2)
    weight = net.fc.weight
    out["metadata"] = (tuple(weight.shape), weight.numel(), weight.dtype, weight.requires_grad,
                       isinstance(weight, torch.nn.Parameter))
    for name, read in READS.items():
        try:
            read(weight)
            out[name] = None
        except ShardedParameterAccessError as err:
            out[name] = str(err)
    ddp.finish_param_sync()
    ref_ddp.finish_param_sync()
    # ZeRO-3's buckets are its units: equal to ZeRO-1 up to fp32 rounding (test_zero.py)
    out["gathered"] = torch.allclose(weight.detach().clone(), ref_net.fc.weight.detach().clone(),
                                     rtol=1e-6, atol=1e-7)
    out["plain result"] = type(weight * 2) is torch.Tensor
    distrib_iteration(ddp, opt, 2, 2)  # the process lives on and trains
    out["after"] = net.fc.weight.numel() > 0
    return out


def test_reading_a_freed_zero3_parameter_raises_a_clear_error():
    results = run_distributed(2, _read_between_iterations)
    for out in results:
        assert out["metadata"] == ((16, 16), 256, torch.float32, True, True)
        for name in READS:
            msg = out[name]
            assert msg is not None, name
            assert "'fc.weight'" in msg and "finish_param_sync()" in msg, (name, msg)
            assert "optim_grads_params" in msg, msg
        assert out["gathered"] and out["plain result"] and out["after"]


def _read_main_grad_between_iterations(strategy):
    from megatron.core.distributed.param_units import ShardedParameterAccessError

    ps.initialize_model_parallel(1, 1)
    net, ddp, opt = _build(strategy, overlap_grad=True)
    for step in range(2):
        distrib_iteration(ddp, opt, step, 2)
    try:
        net.fc.weight.main_grad.sum()  # its storage is freed after the bucket's reduce-scatter
        message = None
    except ShardedParameterAccessError as err:
        message = str(err)
    distrib_iteration(ddp, opt, 2, 2)  # the process lives on and trains
    return message, tuple(net.fc.weight.shape)


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_reading_a_freed_main_grad_raises_a_clear_error(strategy):
    """Before: ``p.main_grad.sum()`` between iterations read the freed gradient storage
    (SIGSEGV) under ZeRO-2 and ZeRO-3."""
    for message, shape in run_distributed(2, _read_main_grad_between_iterations, strategy):
        assert message is not None and "'fc.weight'" in message and "reduced_grad" in message, message
        assert shape == (16, 16)


def test_a_non_sharded_strategy_keeps_plain_parameters():
    from megatron.core.distributed.param_units import ShardedGradParameter

    net, ddp, _ = _build_single("optim")
    assert all(type(p) is torch.nn.Parameter for p in net.parameters())
    net, ddp, _ = _build_single("optim_grads")  # only main_grad is guarded: no per-op check
    assert all(type(p) is ShardedGradParameter for p in net.parameters())
    assert ShardedGradParameter.__torch_function__ is torch.nn.Parameter.__torch_function__
    net, ddp, _ = _build_single("optim_grads_params")
    with pytest.raises(RuntimeError, match="'inp.weight'.*finish_param_sync"):
        net.inp.weight.sum()


def _build_single(strategy):
    from megatron.core.distributed import DistributedDataParallel
    from tests.helpers.toy import Net

    net = Net()
    ddp = DistributedDataParallel(net, data_parallel_group=None, use_distributed_optimizer=True,
                                  data_parallel_sharding_strategy=strategy,
                                  fsdp_unit_modules=(torch.nn.LayerNorm,))
    return net, ddp, None
