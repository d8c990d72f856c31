"""The optimizer step without host syncs (what CUDA runs with torch's fused AdamW): the skip
decision and the clip factor stay on the device, handed to the fused kernel as ``found_inf`` and
``grad_scale``, and nothing is read on the host before the kernel is queued. Forced here on the
CPU (``device_side_step = True``) and compared with the host-side step the CPU runs: the same
skipped iterations, grad norms, parameters, Adam moments and loss scale, within fp32 rounding."""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.toy import CLIP, LR, Net, WD, toy_data

# loss multipliers per iteration: large and small gradients, an inf gradient, a NaN loss
PLAN = [1.0, 40.0, 1e-3, "inf-grad", 20.0, "nan-loss", 3.0]


def _config(precision, clip, distributed=False):
    extra = {"fp16": True, "initial_loss_scale": 2.0 ** 12, "loss_scale_window": 2,
             "hysteresis": 1} if precision == "fp16" else {"bf16": precision == "bf16"}
    return OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=clip,
                           use_distributed_optimizer=distributed, **extra)


def _run(precision, clip, device_side, distributed=False):
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    torch.manual_seed(0)
    net = Net() if precision == "fp32" else Net().to(
        torch.bfloat16 if precision == "bf16" else torch.float16)
    group = ps.get_data_parallel_group() if ps.model_parallel_is_initialized() else None
    ddp = DistributedDataParallel(net, data_parallel_group=group, bucket_size=40,
                                  use_distributed_optimizer=distributed)
    opt = get_megatron_optimizer(_config(precision, clip, distributed), [ddp],
                                 pg_collection=current_groups())
    opt.device_side_step = device_side
    rank = ps.get_data_parallel_rank() if group is not None else 0
    dp = ps.get_data_parallel_world_size() if group is not None else 1
    dtype = net.fc.weight.dtype
    results = []
    for i, what in enumerate(PLAN):
        x, y = toy_data(8 * (i + 1))
        x, y = x[-8:].chunk(dp)[rank], y[-8:].chunk(dp)[rank]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x.to(dtype)).float(), y)
        factor = what if isinstance(what, float) else 1.0
        opt.scale_loss(loss * factor).backward()
        finalize_model_grads([ddp], pg_collection=current_groups())
        if what == "inf-grad":
            net.fc.weight.main_grad.view(-1)[0] = float("inf")
        ok, norm, _ = opt.step(nonfinite_loss=torch.tensor(what == "nan-loss"))
        scale = opt.get_loss_scale().item()
        results.append((ok, norm, scale))
    params = [p.detach().float().clone() for p in net.parameters()]
    moments = [s[k].clone() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return results, [p.tolist() for p in params], [m.tolist() for m in moments]


def _compare(host, device):
    (h_res, h_params, h_moments), (d_res, d_params, d_moments) = host, device
    assert [r[0] for r in d_res] == [r[0] for r in h_res]  # the same iterations skipped
    assert [r[2] for r in d_res] == [r[2] for r in h_res]  # the same loss scale throughout
    for (_, hn, _), (_, dn, _) in zip(h_res, d_res):
        assert (hn is None) == (dn is None)
        if hn is not None and dn is not None:
            assert dn == pytest.approx(hn, rel=1e-6, nan_ok=True)
    for a, b in zip(h_params, d_params):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6)
    # skipped first steps leave zero moments on the device side, none on the host side
    nonzero = [m for m in d_moments if any(v != 0 for v in torch.tensor(m).flatten().tolist())]
    assert len(nonzero) == len(h_moments)
    for a, b in zip(h_moments, nonzero):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("clip", [0.0, CLIP], ids=["no-clip", "clip"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_device_side_step_equals_host_step(precision, clip):
    host, device = _run(precision, clip, False), _run(precision, clip, True)
    assert any(not ok for ok, _, _ in host[0]) and any(ok for ok, _, _ in host[0])
    if clip:
        assert max(n for ok, n, _ in host[0] if ok) > CLIP  # clipping happens
    _compare(host, device)


def _distributed(precision):
    ps.initialize_model_parallel(1, 1)
    return _run(precision, CLIP, False, True), _run(precision, CLIP, True, True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_distributed_optimizer_device_side_step_dp2(precision):
    for host, device in run_distributed(2, _distributed, precision):
        _compare(host, device)


@pytest.mark.parametrize("loss_flag", ["tensor", "bool"], ids=["last-stage", "other-stage"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_nothing_is_read_on_the_host_before_the_kernel_is_queued(monkeypatch, precision, loss_flag):
    """Inside ``step()``, every host read of a tensor (item, tolist, bool, float, int) comes after
    torch's fused AdamW is called, and there is one (the flag and the squared norm together); no
    tensor is made from host data before it either (on CUDA, a copy from the host waits for the
    queue). The loss flag is a device tensor on the last pipeline stage, False elsewhere."""
    from megatron.core.distributed import DistributedDataParallel

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    net = Net().to(dtype)
    ddp = DistributedDataParallel(net, data_parallel_group=None)
    opt = get_megatron_optimizer(_config(precision, CLIP), [ddp], pg_collection=current_groups())
    opt.device_side_step = True
    x, y = toy_data(8)
    ddp.zero_grad_buffer()
    opt.scale_loss(torch.nn.functional.mse_loss(ddp(x.to(dtype)).float(), y)).backward()
    nonfinite_loss = torch.tensor(False) if loss_flag == "tensor" else False
    events = []
    inner = opt.optimizer.step
    monkeypatch.setattr(opt.optimizer, "step",
                        lambda *a, **k: (events.append("kernel"), inner(*a, **k))[1])
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def reading(self, *a, _name=name, _original=original, **k):
            events.append(_name)
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, reading)
    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)

        def making(data, *a, _name=name, _original=original, **k):
            if "kernel" not in events and not isinstance(data, torch.Tensor):
                events.append(f"torch.{_name}")
            return _original(data, *a, **k)
        monkeypatch.setattr(torch, name, making)
    ok, norm, _ = opt.step(nonfinite_loss=nonfinite_loss)
    monkeypatch.undo()
    assert ok and norm > CLIP
    assert events == ["kernel", "tolist"], events
