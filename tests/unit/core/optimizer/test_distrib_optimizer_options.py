"""Distributed optimizer options: bf16 gradient reduction (--no-accumulate-allreduce-grads-in-fp32),
checkpoints converted between the plain and the distributed optimizer (both directions, fp32 and
bf16, continuing exactly as the saving run), and --distributed-checkpointing accepted and reported."""


import pytest
import torch

from megatron.arguments import report_ignored_flags
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.helpers.arguments import base_argv, check
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.toy import BUCKET, CLIP, LR, Net, WD, distrib_iteration


def _build(distributed, bf16=False, fp32_reduction=True):
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16) if bf16 else Net()
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group(),
                                  bucket_size=BUCKET, use_distributed_optimizer=distributed,
                                  accumulate_allreduce_grads_in_fp32=fp32_reduction,
                                  overlap_grad_reduce=distributed, overlap_param_gather=distributed)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, bf16=bf16,
                                                 use_distributed_optimizer=distributed), [ddp],
                                 pg_collection=current_groups())
    return ddp, opt


def _bf16_reduction():
    ps.initialize_model_parallel(1, 1)
    out = {}
    for fp32_reduction in (True, False):
        ddp, opt = _build(True, bf16=True, fp32_reduction=fp32_reduction)
        losses, dtypes = [], set()
        for step in range(4):
            loss, events = distrib_iteration(ddp, opt, step, 2)
            losses.append(loss)
            dtypes |= {str(e["dtype"]) for e in events if e["op"] == "reduce_scatter"}
        out[fp32_reduction] = (losses, sorted(dtypes), str(ddp.buffers[0].grad_data.dtype))
    return out


def test_bf16_gradient_reduction_reduces_in_bf16_and_trains():
    out = run_distributed(2, _bf16_reduction)[0]
    fp32_losses, fp32_dtypes, fp32_buffer = out[True]
    losses, dtypes, buffer = out[False]
    assert fp32_dtypes == ["torch.float32"] and fp32_buffer == "torch.float32"
    assert dtypes == ["torch.bfloat16"] and buffer == "torch.bfloat16"
    assert losses[-1] < losses[0]  # it trains, and close to the fp32-reduction run
    assert losses == pytest.approx(fp32_losses, rel=2e-2)


def _args(folder):
    from megatron.config import CheckpointConfig

    return CheckpointConfig(save=str(folder), load=str(folder), no_load_rng=True)


def _convert(folder):
    """For each dtype and direction: train 2 iterations with one optimizer, save, train 2 more;
    a fresh run of the other optimizer loads the checkpoint and trains the same 2 iterations."""
    from megatron import checkpointing

    ps.initialize_model_parallel(1, 1)
    out = {}
    for bf16 in (False, True):
        for saver in (False, True):  # distributed optimizer saves?
            path = folder / f"bf16{int(bf16)}_dist{int(saver)}"
            ddp, opt = _build(saver, bf16)
            for step in range(2):
                distrib_iteration(ddp, opt, step, 2)
            checkpointing.save_checkpoint(2, [ddp], opt, None, _args(path), current_groups(),
                                          run_flags={}, consumed_train_samples=0,
                                          consumed_valid_samples=0)
            whole = [distrib_iteration(ddp, opt, step, 2)[0] for step in (2, 3)]
            ddp, opt = _build(not saver, bf16)
            loaded = checkpointing.load_checkpoint([ddp], opt, None, _args(path), current_groups(),
                                                   run_flags={})
            assert loaded["iteration"] == 2
            resumed = [distrib_iteration(ddp, opt, step, 2)[0] for step in (2, 3)]
            out[(bf16, saver)] = (whole, resumed)
    return out


def test_plain_and_distributed_checkpoints_load_into_each_other(tmp_path):
    out = run_distributed(2, _convert, tmp_path)[0]
    for (bf16, saver), (whole, resumed) in out.items():
        assert resumed == pytest.approx(whole, rel=1e-5), (bf16, saver)


def test_flags(files):
    args = check(base_argv(files) + ["--bf16", "--no-accumulate-allreduce-grads-in-fp32"])
    assert args.accumulate_allreduce_grads_in_fp32 is False
    for argv in (["--bf16"], ["--bf16", "--accumulate-allreduce-grads-in-fp32"], []):
        assert check(base_argv(files) + argv).accumulate_allreduce_grads_in_fp32 is True
    with pytest.raises(ValueError, match="--no-accumulate-allreduce-grads-in-fp32 goes with --bf16"):
        check(base_argv(files) + ["--fp16", "--no-accumulate-allreduce-grads-in-fp32"])
    args = check(base_argv(files) + ["--use-distributed-optimizer", "--distributed-checkpointing"])
    messages = report_ignored_flags(args)
    assert len(messages) == 1 and messages[0].startswith("--distributed-checkpointing has no effect")
    assert "distrib_optim_dp_DDD.pt" in messages[0]
