"""megatron.training.train.nonfinite_iteration: which skipped iterations are the trouble that
stops saves and, repeated, the run (fp32/bf16: every one; fp16: only at the lowest scale)."""

from types import SimpleNamespace

from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.training.train import loss_scale_at_floor, nonfinite_iteration


def _optimizer(scaler=None):
    return SimpleNamespace(grad_scaler=scaler)


def test_without_a_loss_scaler_every_skipped_step_is_non_finite():
    assert nonfinite_iteration(1, _optimizer(), scale_was_at_floor=False)
    assert not nonfinite_iteration(0, _optimizer(), scale_was_at_floor=False)
    assert not loss_scale_at_floor(_optimizer())


def test_fp16_overflow_is_routine_until_the_scale_reaches_its_floor():
    scaler = DynamicGradScaler(4.0, min_scale=1.0, hysteresis=1)
    opt, seen = _optimizer(scaler), []
    for _ in range(4):  # overflow every iteration: 4 -> 2 -> 1 -> 1 -> 1
        at_floor = loss_scale_at_floor(opt)  # read before the step, as the loop does
        scaler.update(found_inf=True)
        seen.append(nonfinite_iteration(1, opt, at_floor))
    assert seen == [False, False, True, True]
    assert float(scaler.scale) == 1.0


def test_a_constant_loss_scale_cannot_back_off():
    opt = _optimizer(ConstantGradScaler(128.0))
    assert loss_scale_at_floor(opt) and nonfinite_iteration(1, opt, loss_scale_at_floor(opt))
