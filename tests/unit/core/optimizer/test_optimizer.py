"""get_megatron_optimizer against plain torch AdamW: DP=2 fp32, bf16 with fp32 main params,
no decay on 1-D params, exact state_dict round trip."""

import io

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.toy import CLIP, LR, Net, STEPS, WD, reference_adamw, toy_data


def _reference_params(steps):
    def batch(step):
        x, y = toy_data(8 * (step + 1))
        return x[-8:], y[-8:]

    params, norms, _ = reference_adamw(steps, batch)
    return params, norms


def _train_dp(bf16):
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    ps.initialize_model_parallel(1, 1)
    rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16) if bf16 else Net()
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group(), bucket_size=60)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, bf16=bf16),
                                 [ddp], pg_collection=current_groups())
    norms = []
    for step in range(STEPS):
        x, y = toy_data(8 * (step + 1))
        x, y = x[-8:].chunk(dp)[rank], y[-8:].chunk(dp)[rank]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        with ddp.no_sync():
            loss = torch.nn.functional.mse_loss(ddp(x[:2].to(net.fc.weight.dtype)).float(), y[:2])
            (loss / 2).backward()
        loss = torch.nn.functional.mse_loss(ddp(x[2:].to(net.fc.weight.dtype)).float(), y[2:])
        (loss / 2).backward()
        finalize_model_grads([ddp], pg_collection=current_groups())
        ok, norm, zeros = opt.step()
        assert ok and zeros is None
        norms.append(norm)
    if bf16:
        main = [p.detach().clone() for g in opt.fp32_from_float16_groups for p in g]
        model = [p for g in opt.float16_groups for p in g]
        assert all(p.dtype == torch.float32 for p in main)
        assert all(p.dtype == torch.bfloat16 for p in model)
        for mp, p in zip(main, model):  # model params are exactly the rounded main params
            assert torch.equal(mp.to(torch.bfloat16), p)
        # the main params keep the precision bf16 cannot hold
        assert any(not torch.equal(mp, mp.to(torch.bfloat16).float()) for mp in main)
    # Plain lists: tensors sent through the result queue would share memory with an exiting child.
    return {n: p.detach().float().tolist() for n, p in net.named_parameters()}, norms


def test_fp32_dp2_equals_torch_adamw():
    ref, ref_norms = _reference_params(STEPS)
    for params, norms in run_distributed(2, _train_dp, False):
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert ref_norms[0] > CLIP  # clipping is active
        for name, p in params.items():
            torch.testing.assert_close(torch.tensor(p), ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_tracks_fp32_with_fp32_main_params():
    ref, ref_norms = _reference_params(STEPS)
    torch.manual_seed(0)
    init = {n: p.detach().clone() for n, p in Net().named_parameters()}
    params, norms = run_distributed(2, _train_dp, True)[0]
    assert norms == pytest.approx(ref_norms, rel=5e-2)
    for name, p in params.items():
        moved = (ref[name] - init[name]).abs().max().item()
        err = (torch.tensor(p) - ref[name]).abs().max().item()
        assert err < 0.25 * moved + 4e-3, (name, err, moved)


def _zero_grad_step(model, opt):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return opt.step()


def test_no_weight_decay_on_1d_params():
    torch.manual_seed(0)
    net = Net()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.5, clip_grad=0.0), [net],
                                 pg_collection=current_groups())
    decay, no_decay = opt.param_groups
    assert {id(p) for p in decay["params"]} == {id(p) for p in net.parameters() if p.dim() == 2}
    assert decay["weight_decay"] == 0.5 and no_decay["weight_decay"] == 0.0
    assert (decay["wd_mult"], no_decay["wd_mult"]) == (1.0, 0.0)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    assert _zero_grad_step(net, opt) == (True, None, None)
    for n, p in net.named_parameters():  # zero grads: only decoupled decay moves a param
        factor = 1.0 - 0.1 * 0.5 if p.dim() == 2 else 1.0
        torch.testing.assert_close(p.detach(), before[n] * factor, rtol=1e-6, atol=0)


def _run_steps(net, opt, steps, start):
    for step in range(start, start + steps):
        x, y = toy_data(4 * (step + 1))
        opt.zero_grad()
        dtype = net.fc.weight.dtype
        torch.nn.functional.mse_loss(net(x[-4:].to(dtype)).float(), y[-4:]).backward()
        opt.step()


@pytest.mark.parametrize("bf16", [False, True])
def test_state_dict_round_trip_resumes_identically(bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, bf16=bf16)
    torch.manual_seed(0)
    net = Net().to(dtype)
    opt = get_megatron_optimizer(config, [net], pg_collection=current_groups())
    _run_steps(net, opt, 2, 0)
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, buf)
    _run_steps(net, opt, 3, 2)

    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    resumed = Net().to(dtype)
    opt2 = get_megatron_optimizer(config, [resumed], pg_collection=current_groups())
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    _run_steps(resumed, opt2, 3, 2)
    for (n, a), b in zip(net.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
    if bf16:
        for a, b in zip(opt.get_parameters(), opt2.get_parameters()):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_bf16_reload_model_params_and_bad_config():
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [net],
                                 pg_collection=current_groups())
    with torch.no_grad():
        net.fc.weight.fill_(0.5)
    opt.reload_model_params()
    main_fc = opt.fp32_from_float16_groups[0][[id(p) for p in opt.float16_groups[0]].index(id(net.fc.weight))]
    assert torch.equal(main_fc, torch.full_like(main_fc, 0.5))
    with pytest.raises(ValueError, match="--bf16 and --fp16"):
        OptimizerConfig(lr=1.0, bf16=True, fp16=True)
    with pytest.raises(ValueError, match="--lr"):
        OptimizerConfig()
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0, use_distributed_optimizer=True), [net],
                               pg_collection=current_groups())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clip", [0.0, CLIP], ids=["no-clip", "clip"])
def test_a_nonfinite_gradient_skips_the_step(clip, bf16):
    """One inf in one gradient (the loss finite) skips the step and leaves every parameter and
    the Adam state untouched: found by the sum check without clipping, by the gradient norm
    (no separate pass) with it; the next finite step then runs."""
    from megatron.core.distributed import DistributedDataParallel

    torch.manual_seed(0)
    net = Net().to(torch.bfloat16) if bf16 else Net()
    ddp = DistributedDataParallel(net, data_parallel_group=None)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, clip_grad=clip, bf16=bf16), [ddp],
                                 pg_collection=current_groups())
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    x, y = toy_data(4)
    for poison in (True, False):
        ddp.zero_grad_buffer()
        torch.nn.functional.mse_loss(ddp(x.to(net.fc.weight.dtype)).float(), y).backward()
        if poison:
            net.fc.weight.main_grad[0, 0] = float("inf")
        ok, norm, _ = opt.step()
        if poison:
            assert not ok and (norm is None if clip == 0 else norm == float("inf"))
            for n, p in net.named_parameters():
                assert torch.equal(p, before[n]), n
            assert not opt.state  # no Adam state was created
        else:
            assert ok and (norm is None) == (clip == 0)
            assert not torch.equal(net.fc.weight, before["fc.weight"])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_clipping_folds_into_the_fused_step(bf16):
    """With torch's fused AdamW the clip factor reaches the kernel as ``grad_scale`` (no separate
    pass over the gradients): parameters, Adam state and the clipped gradients left behind equal
    those of clipping in place first (the path zero counting keeps), within fp32 rounding."""
    from megatron.core.distributed import DistributedDataParallel

    runs = []
    for count_zeros in (False, True):
        torch.manual_seed(0)
        net = Net().to(torch.bfloat16) if bf16 else Net()
        ddp = DistributedDataParallel(net, data_parallel_group=None)
        opt = get_megatron_optimizer(OptimizerConfig(lr=LR, clip_grad=CLIP, bf16=bf16,
                                                     log_num_zeros_in_grad=count_zeros), [ddp],
 pg_collection=current_groups())
        seen = []
        step = opt.optimizer.step

        def spy(*args, _step=step, _opt=opt.optimizer, _seen=seen, **kwargs):
            _seen.append(getattr(_opt, "grad_scale", None))
            return _step(*args, **kwargs)
        opt.optimizer.step = spy
        norms = []
        for i in range(3):
            x, y = toy_data(4 * (i + 1))
            ddp.zero_grad_buffer()
            torch.nn.functional.mse_loss(ddp(x[-4:].to(net.fc.weight.dtype)).float(), y[-4:]).backward()
            ok, norm, _ = opt.step()
            assert ok and norm > CLIP  # clipping is active every step
            norms.append(norm)
        grads = [g.clone() for g in opt._main_grads()] if bf16 else [
            p.main_grad.clone() for p in net.parameters()]
        runs.append((seen, norms, [p.detach().clone() for p in opt.get_parameters()],
                     [s[k].clone() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")],
                     grads))
    (fold_seen, fold_norms, *fold), (plain_seen, plain_norms, *plain) = runs
    assert all(s is not None and s.item() > 1.0 for s in fold_seen)  # folded: 1 / clip_coeff
    assert all(s is None for s in plain_seen)
    assert fold_norms == pytest.approx(plain_norms, rel=1e-6)
    for fold_tensors, plain_tensors in zip(fold, plain):
        for a, b in zip(fold_tensors, plain_tensors):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # the gradients left behind are the clipped ones: their norm is the clip threshold
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in fold[2]])).item()
    assert clipped == pytest.approx(CLIP, rel=1e-4)


@pytest.mark.parametrize("device_side", [False, True], ids=["host", "device"])
def test_step_runs_the_three_phases_in_order(monkeypatch, device_side):
    """``step()`` is Megatron-Core's prepare_grads -> clip_grad_norm -> step_with_ready_grads
    (the device path's norm phase keeps its tensors on the device); a finite step runs each once,
    an inf/NaN loss stops the host path after the first and lets the kernel skip on the device."""
    from megatron.core.distributed import DistributedDataParallel

    torch.manual_seed(0)
    net = Net()
    ddp = DistributedDataParallel(net, data_parallel_group=None)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, clip_grad=CLIP), [ddp],
                                 pg_collection=current_groups())
    opt.device_side_step = device_side
    calls = []
    for name in ("prepare_grads", "clip_grad_norm", "clip_grad_norm_on_device",
                 "step_with_ready_grads"):
        original = getattr(opt, name)

        def spy(*a, _name=name, _original=original, **k):
            calls.append(_name)
            return _original(*a, **k)
        monkeypatch.setattr(opt, name, spy)
    norm_phase = "clip_grad_norm_on_device" if device_side else "clip_grad_norm"
    x, y = toy_data(4)
    for nonfinite in (False, True):
        calls.clear()
        ddp.zero_grad_buffer()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ok, _, _ = opt.step(nonfinite_loss=nonfinite)
        assert ok != nonfinite
        expected = ["prepare_grads"] if nonfinite and not device_side else [
            "prepare_grads", norm_phase, "step_with_ready_grads"]
        assert calls == expected


def test_distributed_optimizer_refuses_another_data_parallel_group():
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import DistributedOptimizer

    ddp = DistributedDataParallel(Net(), data_parallel_group=None, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="same ProcessGroupCollection"):
        DistributedOptimizer(OptimizerConfig(lr=LR, use_distributed_optimizer=True), [ddp],
                             torch.optim.AdamW, pg_collection=current_groups(),
                             data_parallel_group=object())
