"""The router losses against their closed forms, and the gradient they inject in backward."""

import pytest
import torch

from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe import MoELayer, collect_aux_losses
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import set_aux_loss_scale

E, K, H = 4, 2, 8


def _layer(**kw):
    cfg = MoEConfig(num_experts=E, moe_router_topk=K, **kw)
    return MoELayer(cfg, hidden_size=H, ffn_hidden_size=6, seed=1, layer_number=1,
                    init_method_std=0.5)


def _switch(logits, indices, coeff, sigmoid=False):
    """Fedus et al. eq. 4 with plain loops: c E/(k N^2) sum_e f_e P_e."""
    n = logits.shape[0]
    if sigmoid:
        s = torch.sigmoid(logits)
        scores = s / s.sum(-1, keepdim=True)
    else:
        scores = torch.softmax(logits, -1)
    total = 0.0
    for e in range(E):
        f = sum(int((indices[t] == e).sum()) for t in range(n))
        total = total + f * scores[:, e].sum()
    return coeff * E / (K * n * n) * total


def test_balanced_router_gives_the_coefficient():
    n = 8
    scores = torch.full((n, E), 1.0 / E, dtype=torch.float64)
    counts = torch.full((E,), n * K // E)
    assert moe_utils.load_balancing_part(scores, counts, n, K, 0.3).item() == pytest.approx(0.3, rel=1e-15)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_value_and_gradient(score_function):
    layer = _layer(moe_aux_loss_coeff=0.1, moe_router_score_function=score_function).train()
    x = torch.randn(5, 3, H)
    layer(x).mul(0).sum().backward()  # only the injected loss gradient reaches the router
    with torch.no_grad():
        logits = layer.router.logits(x.view(-1, H))
        indices = layer.router(x.view(-1, H))[2]
    w = layer.router.weight.detach().clone().requires_grad_()
    ref = _switch(x.view(-1, H) @ w.T, indices, 0.1, score_function == "sigmoid")
    ref.backward()
    torch.testing.assert_close(layer.last_losses["load_balancing_loss"], ref.detach())
    torch.testing.assert_close(layer.router.weight.grad, w.grad, rtol=1e-6, atol=1e-9)
    assert collect_aux_losses(layer) == {"load_balancing_loss": pytest.approx(ref.item())}
    assert collect_aux_losses(layer) == {}  # reset


def test_seq_aux_loss_is_the_mean_over_sequences():
    layer = _layer(moe_aux_loss_coeff=0.2, moe_router_load_balancing_type="seq_aux_loss")
    x = torch.randn(6, 3, H)  # s = 6, b = 3
    layer(x)
    with torch.no_grad():
        per_seq = []
        for b in range(3):
            xb = x[:, b]
            _, _, idx = layer.router(xb)
            per_seq.append(_switch(layer.router.logits(xb), idx, 0.2))
    torch.testing.assert_close(layer.last_losses["seq_load_balancing_loss"],
                               torch.stack(per_seq).mean(), rtol=1e-6, atol=0)


def test_z_loss_and_scale():
    layer = _layer(moe_z_loss_coeff=1e-2, moe_aux_loss_coeff=0.0).train()
    x = torch.randn(4, 2, H)
    set_aux_loss_scale(layer, 0.5)
    layer(x).mul(0).sum().backward()
    w = layer.router.weight.detach().clone().requires_grad_()
    ref = 1e-2 * torch.logsumexp(x.view(-1, H) @ w.T, -1).square().mean()
    (0.5 * ref).backward()
    torch.testing.assert_close(layer.last_losses["z_loss"], ref.detach())
    torch.testing.assert_close(layer.router.weight.grad, w.grad, rtol=1e-6, atol=1e-10)


def test_no_loss_no_gradient_from_it():
    layer = _layer(moe_aux_loss_coeff=0.0).train()
    layer(torch.randn(3, 2, H)).mul(0).sum().backward()
    assert torch.equal(layer.router.weight.grad, torch.zeros_like(layer.router.weight))
    assert layer.last_losses == {}


def test_expert_bias_sign_rule_and_counts():
    layer = _layer(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_bias_update_rate=0.01).train()
    x = torch.randn(5, 2, H)
    layer(x)
    _, _, idx = layer.router.eval()(x.view(-1, H))
    counts = torch.bincount(idx.view(-1), minlength=E).float()
    assert torch.equal(layer.router.local_tokens_per_expert, counts)
    layer.router.update_expert_bias(None)
    expected = torch.where(counts < counts.mean(), 0.01, torch.where(counts > counts.mean(), -0.01, 0.0))
    assert torch.equal(layer.router.expert_bias, expected)
    assert torch.equal(layer.router.local_tokens_per_expert, torch.zeros(E))
    assert "router.expert_bias" in layer.state_dict()
    assert "router.local_tokens_per_expert" not in layer.state_dict()


def test_collect_sums_layers_and_logs_each_with_per_layer_logging():
    import dataclasses
    layers = torch.nn.ModuleList([_layer(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-3)
                                  for _ in range(2)])
    layers[1].layer_number = 2
    x = torch.randn(4, 2, H)
    values = []
    for micro_batch in range(2):  # the mean over micro-batches
        for layer in layers:
            layer(x + micro_batch)
            values.append(dict(layer.last_losses))
    mean = lambda i, name: (float(values[i][name]) + float(values[i + 2][name])) / 2
    got = collect_aux_losses(layers, reset=False)
    assert got == {"load_balancing_loss": pytest.approx(mean(0, "load_balancing_loss") +
                                                        mean(1, "load_balancing_loss")),
                   "z_loss": pytest.approx(mean(0, "z_loss") + mean(1, "z_loss"))}
    for layer in layers:
        layer.config = dataclasses.replace(layer.config, moe_per_layer_logging=True)
    got = collect_aux_losses(layers)
    assert got["z_loss layer 2"] == pytest.approx(mean(1, "z_loss"))
    assert len(got) == 6


def test_is_moe_layer():
    from megatron.core.transformer.moe import is_moe_layer
    cfg = MoEConfig(num_experts=4, moe_layer_freq=(0, 1, 1))
    assert [is_moe_layer(cfg, n) for n in (1, 2, 3)] == [False, True, True]
    assert not is_moe_layer(MoEConfig(), 1)
    assert [is_moe_layer(MoEConfig(num_experts=2, moe_layer_freq=2), n) for n in (1, 2, 3)] == \
        [True, False, True]
