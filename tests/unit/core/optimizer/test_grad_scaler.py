"""Loss scalers: Megatron's dynamic rule step by step (hysteresis 1 and 2, window growth, floor),
the constant scaler, state_dict round trip, and the checks naming their flags."""

import pytest
import torch

from megatron.core.optimizer.grad_scaler import (ConstantGradScaler, DynamicGradScaler,
                                                 build_grad_scaler)
from megatron.core.optimizer import OptimizerConfig
from tests.helpers.groups import current_groups


def _trace(scaler, overflows):
    out = []
    for found in overflows:
        scaler.update(found)
        out.append(float(scaler.scale))
    return out


def test_hysteresis_1_halves_on_every_overflow():
    s = DynamicGradScaler(1024.0, 1.0, growth_interval=3, hysteresis=1)
    assert _trace(s, [True, True, False, False, False, True]) == [512, 256, 256, 256, 512, 256]


def test_hysteresis_2_halves_on_the_second_overflow_and_after_until_growth():
    s = DynamicGradScaler(1024.0, 1.0, growth_interval=2, hysteresis=2)
    # 1st overflow spends hysteresis; 2nd halves; a 3rd halves again (hysteresis stays spent);
    # a clean window (2) doubles and refills; then one overflow is tolerated again.
    assert _trace(s, [True, True, True, False, False, True, False, True]) == \
        [1024, 512, 256, 256, 512, 512, 512, 256]


def test_clean_iterations_between_overflows_do_not_refill_hysteresis():
    s = DynamicGradScaler(64.0, 1.0, growth_interval=3, hysteresis=2)
    assert _trace(s, [True, False, False, True]) == [64, 64, 64, 32]


def test_growth_after_window_and_floor():
    s = DynamicGradScaler(4.0, 2.0, growth_interval=2, hysteresis=1)
    assert _trace(s, [False, False, False, False]) == [4, 8, 8, 16]
    assert _trace(s, [True] * 5) == [8, 4, 2, 2, 2]
    assert float(s.inv_scale) == 0.5


def test_state_dict_round_trip_continues_identically():
    a = DynamicGradScaler(2.0 ** 16, 1.0, growth_interval=3, hysteresis=2)
    _trace(a, [True, False])
    b = DynamicGradScaler(2.0 ** 16, 1.0, growth_interval=3, hysteresis=2)
    sd = a.state_dict()
    assert set(sd) == {"scale", "growth_tracker", "hysteresis_tracker"}
    b.load_state_dict({**sd, "scale": sd["scale"].reshape(1)})  # Megatron's [1] tensor loads too
    seq = [False, False, True, True, False]
    assert _trace(a, seq) == _trace(b, seq)


def test_constant_scaler_and_builder():
    c = build_grad_scaler(OptimizerConfig(lr=1.0, fp16=True, loss_scale=128.0))
    assert isinstance(c, ConstantGradScaler)
    assert _trace(c, [True, False, True]) == [128, 128, 128]
    d = build_grad_scaler(OptimizerConfig(lr=1.0, fp16=True, initial_loss_scale=256.0,
                                          min_loss_scale=4.0, loss_scale_window=7, hysteresis=3))
    assert isinstance(d, DynamicGradScaler)
    assert (float(d.scale), float(d.min_scale), d.growth_interval, d.hysteresis) == (256, 4, 7, 3)
    assert build_grad_scaler(OptimizerConfig(lr=1.0, bf16=True)) is None
    # The loss on another dtype/device multiplies by the 0-d scale without a copy.
    assert (torch.ones(2, dtype=torch.float16) * d.scale).dtype == torch.float16


@pytest.mark.parametrize("kwargs, flag", [
    ({"initial_scale": 0.0, "min_scale": 1.0}, "loss scale"),
    ({"initial_scale": 8.0, "min_scale": 16.0}, "--min-loss-scale"),
    ({"initial_scale": 8.0, "min_scale": 1.0, "hysteresis": 0}, "--hysteresis"),
    ({"initial_scale": 8.0, "min_scale": 1.0, "growth_interval": 0}, "--loss-scale-window"),
])
def test_bad_settings_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DynamicGradScaler(**kwargs)


def test_fp16_optimizer_unscales_skips_overflow_and_checkpoints_the_scaler():
    """Single process: the scaled loss's gradients come back unscaled; an overflow leaves params
    and Adam state untouched; the scaler's state travels in the optimizer's state_dict."""
    from megatron.core.optimizer import get_megatron_optimizer

    def make():
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3).half()
        config = OptimizerConfig(lr=0.1, fp16=True, initial_loss_scale=1024.0, hysteresis=1,
                                 loss_scale_window=2, clip_grad=0.0)
        return net, get_megatron_optimizer(config, [net], pg_collection=current_groups())

    net, opt = make()
    x = torch.randn(5, 4).half()
    before = [p.detach().clone() for p in net.parameters()]
    opt.scale_loss(net(x).float().pow(2).sum() * 1e4).backward()  # 1024 x 1e4 x grads: fp16 inf
    assert opt.step()[0] is False and float(opt.get_loss_scale()) == 512
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters())) and not opt.state
    opt.zero_grad()
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict({k: v.float() for k, v in net.state_dict().items()})
    ref(x.float()).pow(2).sum().backward()
    opt.scale_loss(net(x).float().pow(2).sum()).backward()
    assert opt.step()[0] is True
    for p_main, p_ref in zip(opt.get_parameters(), ref.parameters()):
        torch.testing.assert_close(p_main.grad, p_ref.grad, rtol=2e-3, atol=2e-3)  # unscaled
    sd = opt.state_dict()
    assert sd["grad_scaler"] == {"scale": torch.tensor(512.0), "growth_tracker": 1,
                                 "hysteresis_tracker": 0}
    _, fresh = make()
    fresh.load_state_dict(sd)
    fresh.grad_scaler.update(False)  # the next clean iteration completes the window of 2
    assert float(fresh.get_loss_scale()) == 1024
