"""The MLP seam: a layer takes its MLP from megatron.model.mlp_factory; a plug-in MLP with an
auxiliary loss adds that loss's gradient to backward exactly as if it were added to the loss."""

import pytest
import torch

from megatron.model import mlp_factory, transformer
from megatron.model.llama import LlamaModel
from megatron.model.mlp import SwiGLUMLP
from tests.helpers.groups import current_groups
from tests.helpers.model import batch, small_config


class _SquaredPenaltyMLP(torch.nn.Module):
    """A stand-in for a MoE layer: the dense MLP plus the aux loss ``c * mean(out^2)``."""

    def __init__(self, config, layer_number, *, pg_collection, device=None):
        super().__init__()
        self.inner = SwiGLUMLP(config, layer_number, pg_collection=pg_collection, device=device)
        self.coeff = 3e4  # the outputs of std-0.02 weights are ~1e-3

    def forward(self, hidden):
        out = self.inner(hidden)
        return out, self.coeff * out.pow(2).mean()


@pytest.fixture
def penalty_kind():
    mlp_factory.register_mlp("test-penalty", _SquaredPenaltyMLP)
    yield "test-penalty"
    mlp_factory._BUILDERS.pop("test-penalty")
    mlp_factory.AUX_LOSSES.clear()


def test_every_layer_is_dense_swiglu_today():
    model = LlamaModel(small_config(num_layers=3), pg_collection=current_groups())
    assert [type(l.mlp) for l in model.layers] == [SwiGLUMLP] * 3
    assert [l.mlp_kind for l in model.layers] == ["dense"] * 3


def test_unknown_kind_and_double_registration_are_refused(penalty_kind):
    with pytest.raises(ValueError,
                       match="no MLP builder registered for 'expert-choice'.*known: dense, moe"):
        mlp_factory.build_mlp(small_config(), 1, pg_collection=current_groups(),
                              kind="expert-choice")
    with pytest.raises(ValueError, match="already registered"):
        mlp_factory.register_mlp(penalty_kind, _SquaredPenaltyMLP)


@pytest.mark.parametrize("recompute", [None, "selective"])
def test_aux_loss_joins_backward_with_weight_one(penalty_kind, monkeypatch, recompute):
    """Oracle: the same weights with the dense MLP, the penalty computed by forward hooks and
    added to the loss by hand."""
    config = small_config(recompute_granularity=recompute)
    monkeypatch.setattr(transformer, "mlp_kind", lambda c, n, moe_config=None: penalty_kind)
    plugged = LlamaModel(config, pg_collection=current_groups())
    monkeypatch.undo()
    assert [type(l.mlp) for l in plugged.layers] == [_SquaredPenaltyMLP] * 2
    plain = LlamaModel(config, pg_collection=current_groups())
    plain.load_state_dict({k.replace("mlp.inner.", "mlp."): v
                           for k, v in plugged.state_dict().items()})
    tokens, labels = batch(config)

    loss = plugged(tokens, labels=labels)
    loss.sum().backward()
    penalties = []
    hooks = [l.mlp.register_forward_hook(lambda m, i, o: penalties.append(3e4 * o.pow(2).mean()))
             for l in plain.layers]
    ref = plain(tokens, labels=labels)
    (ref.sum() + sum(penalties)).backward()
    for h in hooks:
        h.remove()

    torch.testing.assert_close(loss, ref, rtol=0, atol=0)  # the aux loss leaves the loss alone
    assert sum(penalties) > 1e-3  # the penalty's gradient is not negligible
    grads = {k.replace("mlp.inner.", "mlp."): p.grad for k, p in plugged.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")
    recorded = mlp_factory.AUX_LOSSES
    assert sorted(recorded) == [(penalty_kind, 1), (penalty_kind, 2)]
    torch.testing.assert_close(recorded[(penalty_kind, 1)][0], penalties[0].detach())
    assert recorded[(penalty_kind, 1)][1] == 1
