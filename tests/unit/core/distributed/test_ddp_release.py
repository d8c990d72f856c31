"""A trained DistributedDataParallel wrapper, its model, buffers and optimizer are freed once the
caller drops them, and the process groups they used then close (gloo's threads end).

The wrapper's gradient hooks live on the parameters, where autograd's C++ side holds them out of
the garbage collector's sight: a hook holding the wrapper strongly kept every model a process
trained alive, with its buffers and groups (12 gloo threads per rank for each 4-rank ZeRO-3 run
of the tests' warm worlds, which ran slower and slower)."""

import gc
import os
import weakref

import pytest
import torch

from tests.helpers.dist import gloo_threads, run_distributed

STRATEGIES = [("plain", {}),
              ("distributed optimizer", {"use_distributed_optimizer": True,
                                         "overlap_param_gather": True}),
              ("ZeRO-2", {"use_distributed_optimizer": True,
                          "data_parallel_sharding_strategy": "optim_grads",
                          "overlap_grad_reduce": True}),
              ("ZeRO-3", {"use_distributed_optimizer": True,
                          "data_parallel_sharding_strategy": "optim_grads_params",
                          "fsdp_unit_modules": (torch.nn.LayerNorm,)})]


def _train_and_drop(kwargs):
    """Trains the toy network two iterations over a DP group of its own, drops everything;
    returns (wrapper freed, module freed, gloo threads before, while training, after)."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.helpers.groups import current_groups
    from tests.helpers.toy import BUCKET, CLIP, LR, WD, Net, distrib_iteration

    gc.collect()
    before = gloo_threads()
    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    net = Net()
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group(),
                                  bucket_size=BUCKET, **kwargs)
    opt = get_megatron_optimizer(
        OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                        use_distributed_optimizer=kwargs.get("use_distributed_optimizer", False)),
        [ddp], pg_collection=current_groups())
    for step in range(2):
        distrib_iteration(ddp, opt, step, 2)
    during = gloo_threads()
    freed_ddp, freed_net = weakref.ref(ddp), weakref.ref(net)
    del net, ddp, opt
    ps.destroy_model_parallel()
    for group in [g for g in dist.distributed_c10d._world.pg_map if g is not dist.GroupMember.WORLD]:
        dist.destroy_process_group(group)
    del group
    gc.collect()
    return freed_ddp() is None, freed_net() is None, before, during, gloo_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("name, kwargs", STRATEGIES, ids=[s[0] for s in STRATEGIES])
def test_a_dropped_wrapper_frees_its_model_and_groups(name, kwargs):
    for freed_ddp, freed_net, before, during, after in run_distributed(2, _train_and_drop, kwargs):
        assert freed_ddp and freed_net, f"{name}: the wrapper or its module outlived the caller"
        assert during > before, "the training made no group of its own: the check below is void"
        assert after == before, f"{name}: {after - before} gloo threads of dropped groups still run"


def _drop_the_wrapper_keep_the_module():
    """Wraps the toy network, trains one backward through the wrapper, drops only the wrapper:
    the module's own backward then gives plain ``.grad`` equal to an unwrapped copy's."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from tests.helpers.toy import Net, toy_data

    ps.initialize_model_parallel(1, 1)
    x, y = toy_data(4)
    torch.manual_seed(0)
    net = Net()
    torch.manual_seed(0)
    plain = Net()
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group())
    ddp.zero_grad_buffer()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    assert all(p.grad is None for p in net.parameters())  # through the wrapper: main_grad
    del ddp
    gc.collect()
    for model in (net, plain):
        torch.nn.functional.mse_loss(model(x), y).backward()
    for (name, p), q in zip(net.named_parameters(), plain.parameters()):
        assert "main_grad" not in vars(p), name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    return True


def test_a_module_outliving_its_wrapper_trains_as_a_plain_module():
    assert run_distributed(1, _drop_the_wrapper_keep_the_module) == [True]
