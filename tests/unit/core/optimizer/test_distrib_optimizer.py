"""Distributed optimizer against plain single-process AdamW (gloo, fp32): DP=2 and DP=4, 1 and 4
micro-batches, every overlap; exact collective counts and sizes; optimizer-state bytes; saved
weights equal the next forward's; a DP=4 checkpoint resumed at DP=2 continues the DP=4 run."""


import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.toy import (BUCKET, CLIP, LR, Net, WD, distrib_batch,
                               distrib_iteration, reference_adamw)

STEPS = 3


def _build(overlap_grad, overlap_param, bf16=False):
    from megatron.core.distributed import DistributedDataParallel

    torch.manual_seed(0)
    net = Net().to(torch.bfloat16) if bf16 else Net()
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group(),
                                  bucket_size=BUCKET, overlap_grad_reduce=overlap_grad,
                                  use_distributed_optimizer=True,
                                  overlap_param_gather=overlap_param)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, bf16=bf16,
                                                 use_distributed_optimizer=True), [ddp],
                                 pg_collection=current_groups())
    return net, ddp, opt


def _check_counts(ddp, events):
    buckets = ddp.buffers[0].buckets
    rs = [e for e in events if e["op"] == "reduce_scatter"]
    ag = [e for e in events if e["op"] == "all_gather"]
    assert [e["bucket"] for e in rs] == list(range(len(buckets)))           # backward order
    assert [e["bucket"] for e in ag] == list(reversed(range(len(buckets))))  # forward order
    psi = sum(p.numel() for p in ddp.module.parameters())
    psi_pad = sum(b.numel_padded for b in buckets)
    assert sum(e["numel"] for e in rs) == sum(e["numel"] for e in ag) == psi_pad
    assert psi <= psi_pad <= 1.01 * psi
    return psi, psi_pad


def _train_and_count():
    """Every overlap combination and 1 / 4 micro-batches; counts checked each iteration."""
    ps.initialize_model_parallel(1, 1)
    dp = ps.get_data_parallel_world_size()
    out = {}
    for num_mb in (1, 4):
        for overlap in ((False, False), (True, False), (True, True)):
            net, ddp, opt = _build(*overlap)
            assert len(ddp.buffers[0].buckets) >= 4
            losses = []
            for step in range(STEPS):
                loss, events = distrib_iteration(ddp, opt, step, num_mb)
                losses.append(loss)
                psi, psi_pad = _check_counts(ddp, events)
            if overlap[0]:  # every bucket but the last launched before the last gradient
                assert ddp.launched_before_last_grad == len(ddp.buffers[0].buckets) - 1
            ddp.finish_param_sync()
            # fp32: main params are the parameter buffer's shard views, state = two moments of
            # this rank's contiguous slice of every bucket, padding included.
            owned = sum(r.numel_real for r in opt.runs)
            assert opt.state_bytes() * dp == 8 * psi_pad
            out[(num_mb, overlap)] = ({n: p.detach().clone() for n, p in net.named_parameters()},
                                      losses, owned, psi)
    net, ddp, opt = _build(True, True, bf16=True)
    for step in range(2):
        distrib_iteration(ddp, opt, step, 2)
    psi_pad = sum(b.numel_padded for b in ddp.buffers[0].buckets)
    assert opt.state_bytes() * dp == 12 * psi_pad  # fp32 main params too
    ddp.finish_param_sync()
    for model_shard, main in opt.shards:  # model shard == bf16-rounded main; others gathered
        assert torch.equal(model_shard, main.to(torch.bfloat16))
    for b in ddp.buffers[0].buckets:  # padding never becomes non-zero
        assert not b.param_data[b.numel_unpadded:].any()
    gathered = torch.cat([p.detach().float().view(-1) for p in net.parameters()])
    everyone = [torch.zeros_like(gathered) for _ in range(dp)]
    torch.distributed.all_gather(everyone, gathered)
    assert all(torch.equal(everyone[0], t) for t in everyone)
    return out


@pytest.mark.parametrize("dp", [2, 4])
def test_equals_adamw_counts_and_state_bytes(dp):
    ref, _, ref_losses = reference_adamw(STEPS, distrib_batch)
    results = run_distributed(dp, _train_and_count)
    for case, (params, losses, _, _) in results[0].items():
        assert losses == pytest.approx(ref_losses, rel=1e-5), case
        for name, p in params.items():
            torch.testing.assert_close(p, ref[name], rtol=1e-5, atol=1e-6, msg=f"{case} {name}")
    for case in results[0]:  # the shards partition the model: sum of owned elements == psi
        assert sum(r[case][2] for r in results) == results[0][case][3]


def _args(folder, **kw):
    from megatron.config import CheckpointConfig

    return CheckpointConfig(save=str(folder), load=str(folder), no_load_rng=True, **kw)


def _save_then_continue(folder, steps_before, steps_after):
    """DP=4: train, save (with a param all-gather in flight), check the saved weights are those
    the next forward uses, then train on; losses after the save."""
    from megatron import checkpointing

    ps.initialize_model_parallel(1, 1)
    net, ddp, opt = _build(True, True)
    for step in range(steps_before):
        distrib_iteration(ddp, opt, step, 2)
    checkpointing.save_checkpoint(steps_before, [ddp], opt, None, _args(folder), current_groups(),
                                  run_flags={}, consumed_train_samples=0, consumed_valid_samples=0)
    assert all(b.param_handle is None for b in ddp.buffers[0].buckets)  # save waited for them
    seen = {}

    def capture(module, _inputs, _output):  # the weights the forward has just used
        seen.setdefault("w", {k: v.clone() for k, v in module.state_dict().items()})

    handle = net.register_forward_hook(capture)
    losses = [distrib_iteration(ddp, opt, steps_before + k, 2)[0] for k in range(steps_after)]
    handle.remove()
    path = checkpointing.checkpoint_name_of(str(folder), steps_before, current_groups())
    saved = torch.load(path, weights_only=True)["model"]
    for k, v in seen["w"].items():
        assert torch.equal(saved[k], v), k
    return losses


def _resume(folder, steps_before, steps_after):
    from megatron import checkpointing

    ps.initialize_model_parallel(1, 1)
    _, ddp, opt = _build(True, True)
    loaded = checkpointing.load_checkpoint([ddp], opt, None, _args(folder), current_groups(),
                                           run_flags={})
    assert loaded["iteration"] == steps_before
    return [distrib_iteration(ddp, opt, steps_before + k, 4)[0] for k in range(steps_after)]


def test_save_dp4_resume_dp2(tmp_path):
    uninterrupted = run_distributed(4, _save_then_continue, tmp_path, 2, 2)[0]
    resumed = run_distributed(2, _resume, tmp_path, 2, 2)[0]
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)
    shards = sorted(p.name for p in (tmp_path / "iter_0000002" / "mp_rank_00").iterdir())
    assert shards == [f"distrib_optim_dp_{r:03d}.pt" for r in range(4)] + ["model_optim_rng.pt"]
