"""ZeRO-2 / ZeRO-3 (``--data-parallel-sharding-strategy optim_grads`` / ``optim_grads_params``)
on the toy network (gloo, fp32, clipping active): at DP=2 and DP=4 with 1 micro-batch ZeRO-2
equals the distributed optimizer (``optim``) bitwise, with 4 micro-batches and the overlapped
reduce-scatter (one reduce-scatter per micro-batch) within rtol 1e-6 / atol 1e-7, and every
strategy equals plain single-process AdamW within rtol 1e-6; a step with one rank's inf/NaN
gradient is skipped on every rank with shards, gathered parameters and moments unchanged; the
collectives counted (ZeRO-3: per micro-batch one all-gather of every parameter for forward and
one for backward, one reduce-scatter of every gradient); the bytes held per rank equal the
formulas; torch-format state dicts round-trip."""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.toy import (BUCKET, CLIP, LR, Net, WD, distrib_batch, distrib_iteration,
                               reference_adamw)

STEPS = 4
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


def _build(strategy, overlap_grad):
    from megatron.core.distributed import DistributedDataParallel

    torch.manual_seed(0)
    net = Net()
    # Units: the LayerNorm (its own all-gather per pass); the rest is the root unit (Net reads
    # inp.weight outside inp's forward, so inp cannot be a unit of its own).
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group(),
                                  bucket_size=BUCKET, overlap_grad_reduce=overlap_grad,
                                  use_distributed_optimizer=True,
                                  data_parallel_sharding_strategy=strategy,
                                  fsdp_unit_modules=(torch.nn.LayerNorm,))
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                                                 use_distributed_optimizer=True), [ddp],
                                 pg_collection=current_groups())
    return net, ddp, opt


def _bytes(ddp):
    buckets = [b for buf in ddp.buffers for b in buf.buckets]
    return sum(b.numel_padded for b in buckets), max(b.numel_padded for b in buckets)


def _check_zero3_counts(ddp, events, num_mb):
    units = ddp.param_units.units
    assert [len(u.buckets) for u in units] == [1, 1]  # root, LayerNorm
    psi_pad, _ = _bytes(ddp)
    ag = [e for e in events if e["op"] == "all_gather"]
    rs = [e for e in events if e["op"] == "reduce_scatter"]
    # forward: root then norm; backward: root (the loss) then norm; per micro-batch
    root, norm = units[0].buckets[0].index, units[1].buckets[0].index
    assert [e["bucket"] for e in ag] == [root, norm, root, norm] * num_mb
    assert sum(e["numel"] for e in ag) == 2 * num_mb * psi_pad
    # one reduce-scatter of every bucket per micro-batch, as each bucket's gradients are final
    assert sorted(e["bucket"] for e in rs) == sorted([0, 1] * num_mb)
    assert sum(e["numel"] for e in rs) == num_mb * psi_pad


def _train():
    ps.initialize_model_parallel(1, 1)
    dp = ps.get_data_parallel_world_size()
    out = {}
    for num_mb, overlap in ((1, False), (4, True)):
        for strategy in STRATEGIES:
            net, ddp, opt = _build(strategy, overlap)
            losses = []
            for step in range(STEPS):
                loss, events = distrib_iteration(ddp, opt, step, num_mb)
                losses.append(loss)
                mem = ddp.memory_bytes()
                psi_pad, _ = _bytes(ddp)
                if strategy == "optim":
                    assert mem["grads"] == mem["params"] == 4 * psi_pad
                    continue
                # after the step: fp32 gradient shards only, 4 Psi / N
                assert mem["grads"] == 0 and mem["grad_shards"] * dp == 4 * psi_pad
                if strategy == "optim_grads":
                    assert mem["params"] == 4 * psi_pad and mem["param_shards"] == 0
                    continue
                _check_zero3_counts(ddp, events, num_mb)
                # fp32 params: 4 Psi / N held; nothing gathered between iterations; the
                # gather window is both units at once (the root is in use around the norm)
                assert mem["params"] == 0 and mem["param_shards"] * dp == 4 * psi_pad
                assert ddp.param_units.peak_gathered_bytes == 4 * psi_pad
                ddp.param_units.reset_peak()
            # fp32 optimizer state: 8 Psi / N (the main params are the shards themselves)
            assert opt.state_bytes() * dp == 8 * psi_pad
            ddp.finish_param_sync()
            params = {n: p.detach().clone() for n, p in net.named_parameters()}
            out[(num_mb, strategy, overlap)] = (params, losses)
            if strategy == "optim_grads_params":
                state = ddp.state_dict()
                _roundtrip(ddp, state)
    return out


def _roundtrip(ddp, state):
    """A ZeRO-3 state dict (gathered on every rank) loads into a fresh ZeRO-3 model: the same
    shards, the full parameters freed again."""
    _, fresh, _ = _build("optim_grads_params", False)
    with pytest.raises(RuntimeError, match="finish_param_sync"):
        fresh.module.state_dict()  # as checkpointing reads it
    fresh.finish_param_sync()
    fresh.load_state_dict(state)
    for a, b in zip(fresh.buffers[0].buckets, ddp.buffers[0].buckets):
        assert torch.equal(a.param_shard, b.param_shard)
        assert not a.params_gathered


@pytest.mark.parametrize("dp", [2, 4])
def test_strategies_equal_distributed_optimizer_and_adamw(dp):
    ref, _, ref_losses = reference_adamw(STEPS, distrib_batch)
    results = run_distributed(dp, _train)[0]
    for (num_mb, strategy, overlap), (params, losses) in results.items():
        base_params, base_losses = results[(num_mb, "optim", overlap)]
        case = (num_mb, strategy, overlap)
        if strategy == "optim_grads" and num_mb == 1:  # the same buckets and sums: bitwise
            assert losses == base_losses, case
            for name, p in params.items():
                assert torch.equal(p, base_params[name]), (case, name)
        if strategy == "optim_grads" and num_mb > 1:
            # reduce-scattered per micro-batch: per-micro-batch sums over ranks, then a sum over
            # micro-batches (ZeRO-1 sums micro-batches first): fp32 rounding, measured at most
            # 1.2e-7 relative in the loss and 5.5e-6 relative in near-zero weight elements
            assert losses == pytest.approx(base_losses, rel=1e-6), case
            for name, p in params.items():
                torch.testing.assert_close(p, base_params[name], rtol=1e-6, atol=1e-7,
                                           msg=f"{case} {name}")
        # ZeRO-3's buckets are its units: the norm sums its squares in other pieces
        for name, p in params.items():
            torch.testing.assert_close(p, ref[name], rtol=1e-6, atol=1e-7, msg=f"{case} {name}")
        assert losses == pytest.approx(ref_losses, rel=1e-6), case


def test_strategy_checks():
    from megatron.core.distributed import DistributedDataParallel

    with pytest.raises(ValueError, match="must be one of"):
        DistributedDataParallel(Net(), data_parallel_group=None, use_distributed_optimizer=True,
                                data_parallel_sharding_strategy="zero3")
    with pytest.raises(ValueError, match="needs use_distributed_optimizer"):
        DistributedDataParallel(Net(), data_parallel_group=None,
                                data_parallel_sharding_strategy="optim_grads")
    with pytest.raises(ValueError, match="overlap-param-gather"):
        DistributedDataParallel(Net(), data_parallel_group=None, use_distributed_optimizer=True,
                                overlap_param_gather=True,
                                data_parallel_sharding_strategy="optim_grads_params")


def _offload_and_bf16():
    """--optimizer-cpu-offload: the same numbers as without, the state in host tensors of its
    own; bf16 ZeRO-3: the bytes of Megatron-FSDP's formulas."""
    from megatron.core.distributed import DistributedDataParallel

    ps.initialize_model_parallel(1, 1)
    dp = ps.get_data_parallel_world_size()
    out = {}
    for strategy in ("optim", "optim_grads_params"):
        for offload in (False, True):
            torch.manual_seed(0)
            net = Net()
            ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group(),
                                          bucket_size=BUCKET, use_distributed_optimizer=True,
                                          data_parallel_sharding_strategy=strategy,
                                          fsdp_unit_modules=(torch.nn.LayerNorm,))
            opt = get_megatron_optimizer(
                OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                                use_distributed_optimizer=True, optimizer_cpu_offload=offload),
                [ddp], pg_collection=current_groups())
            losses = [distrib_iteration(ddp, opt, step, 2)[0] for step in range(STEPS)]
            if offload:
                model = {p.untyped_storage().data_ptr() for p in net.parameters()}
                model |= {b.param_shard.untyped_storage().data_ptr()
                          for buf in ddp.buffers for b in buf.buckets}
                for model_shard, main in opt.shards:
                    assert main.device.type == "cpu" and main.dtype == torch.float32
                    assert main.untyped_storage().data_ptr() not in model
                for r in opt.runs:
                    state = opt.optimizer.state[r.main]
                    assert state["exp_avg"].device.type == "cpu"
                    assert r.host_grad.untyped_storage().data_ptr() not in model
                assert all(p.device.type == "cpu" for p in net.parameters())  # the model's
            ddp.finish_param_sync()
            out[(strategy, offload)] = (losses, [p.detach().clone() for p in net.parameters()])
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group(),
                                  use_distributed_optimizer=True,
                                  data_parallel_sharding_strategy="optim_grads_params",
                                  fsdp_unit_modules=(torch.nn.LayerNorm,))
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                                                 bf16=True, use_distributed_optimizer=True),
                                 [ddp], pg_collection=current_groups())
    for step in range(2):
        distrib_iteration(ddp, opt, step, 2)
    psi_pad, _ = _bytes(ddp)
    mem = ddp.memory_bytes()
    window = 2 * psi_pad  # both units at once: the root is in use around the LayerNorm
    out["bf16"] = (mem["param_shards"] * dp, 2 * psi_pad, ddp.param_units.peak_gathered_bytes,
                   window, mem["grad_shards"] * dp, 4 * psi_pad, opt.state_bytes() * dp,
                   12 * psi_pad, mem["params"], mem["grads"])
    return out


def test_cpu_offload_exact_and_bf16_zero3_bytes():
    out = run_distributed(2, _offload_and_bf16)[0]
    for strategy in ("optim", "optim_grads_params"):
        (l0, p0), (l1, p1) = out[(strategy, False)], out[(strategy, True)]
        assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1)), strategy
    shards, shard_formula, peak, window, grads, grads_formula, state, state_formula, params, \
        full_grads = out["bf16"]
    assert shards == shard_formula        # bf16 params 2 Psi / N
    assert peak == window                 # + the gather window
    assert grads == grads_formula         # fp32 gradient shards 4 Psi / N
    assert state == state_formula         # fp32 main + two moments 12 Psi / N
    assert params == full_grads == 0      # nothing full held between iterations


# Step 2: rank 1's gradients inf; step 4: rank 0's NaN. Both skipped on every rank.
POISON = {2: (1, float("inf")), 4: (0, float("nan"))}
SKIP_STEPS = 6


def _full_params(ddp, net):
    ddp.finish_param_sync()  # ZeRO-3: gathers every unit (freed again by the next forward)
    return [p.detach().clone() for p in net.parameters()]


def _state(ddp, opt):
    shards = [b.param_shard.clone() for buf in ddp.buffers for b in buf.buckets
              if b.param_shard is not None]
    moments = [v.clone() for s in opt.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor)]
    return shards, moments


def _train_with_nonfinite_steps():
    ps.initialize_model_parallel(1, 1)
    out = {}
    for strategy in ("optim", "optim_grads_params"):
        net, ddp, opt = _build(strategy, overlap_grad=True)
        losses, unchanged = [], []
        for step in range(SKIP_STEPS):
            before, state = _full_params(ddp, net), _state(ddp, opt)
            loss, _ = distrib_iteration(ddp, opt, step, 2, poison=POISON.get(step))
            mem = ddp.memory_bytes()
            if strategy == "optim_grads_params":  # nothing full held after a skip either
                assert mem["params"] == mem["grads"] == 0, (step, mem)
            if step in POISON:
                after, state_after = _full_params(ddp, net), _state(ddp, opt)
                unchanged.append(all(torch.equal(a, b) for a, b in zip(before, after))
                                 and all(len(x) > 0 and all(torch.equal(a, b) for a, b in
                                                            zip(x, y))
                                         for x, y in zip(state, state_after)))
            else:
                losses.append(loss)
        out[strategy] = (_full_params(ddp, net), losses, unchanged)
    return out


def test_zero3_skips_a_nonfinite_step_on_every_rank():
    """One rank's inf (step 2) or NaN (step 4) gradient: ``step()`` reports the skip on every
    rank (asserted in distrib_iteration), the parameter shards, the gathered full parameters and
    the moments are left bitwise unchanged, and training goes on as if the step had not been
    taken: equal to the distributed optimizer's run and to plain AdamW on the kept batches
    (rtol 1e-6, fp32)."""
    results = run_distributed(2, _train_with_nonfinite_steps)
    kept = [s for s in range(SKIP_STEPS) if s not in POISON]
    ref, _, ref_losses = reference_adamw(len(kept), lambda i: distrib_batch(kept[i]))
    ref = list(ref.values())
    for rank in results:
        for strategy, (params, losses, unchanged) in rank.items():
            assert unchanged == [True, True], strategy
            assert losses == pytest.approx(ref_losses, rel=1e-6), strategy
            for p, r in zip(params, ref):
                torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7, msg=strategy)
        zero1, zero3 = rank["optim"], rank["optim_grads_params"]
        assert zero3[1] == pytest.approx(zero1[1], rel=1e-6)
