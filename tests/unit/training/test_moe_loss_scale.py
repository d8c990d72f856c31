"""The router losses' gradient per iteration (megatron/training/moe_loss_scale.py) against the
single-process math written out: with and without ``--calculate-per-token-loss``, a MoE model's
gradient after the schedule and ``finalize_model_grads`` is

    d/dw [ lm + (1/M) sum_m (aux_m + z_m) ],

``lm`` the per-token loss ``sum_m sum_t mask l / T`` (T the iteration's loss tokens) or the mean
``(1/M) sum_m sum_t mask l / n_m``, and the router losses' closed forms (Switch eq. 4, ST-MoE
eq. 5). So the router losses' gradient contribution is the same with and without per-token loss,
and follows the number of micro-batches M (``--rampup-batch-size``)."""

from functools import partial

import pytest
import torch

from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.common import PipelineConfig
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.training.moe_loss_scale import prepare_moe_iteration

E, K, H, S, B, V = 4, 2, 8, 6, 2, 5
AUX, ZC = 0.3, 0.05


class _Tiny(torch.nn.Module):
    """embedding -> MoE layer -> output layer -> per-token cross entropy ``[s, b]``."""

    def __init__(self, cfg):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, H)
        self.moe = MoELayer(cfg, hidden_size=H, ffn_hidden_size=6, seed=3, layer_number=1,
                            init_method_std=0.5)
        self.head = torch.nn.Linear(H, V, bias=False)

    def forward(self, tokens, labels):
        x = self.moe(self.embed(tokens))  # [s, b, h]
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, V), labels.view(-1),
                                                 reduction="none").view(S, B)


def _batches(m):
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(m):
        tokens = torch.randint(0, V, (S, B), generator=g)
        labels = torch.randint(0, V, (S, B), generator=g)
        mask = (torch.rand(S, B, generator=g) < (0.3 + 0.2 * i)).float()  # unequal counts
        mask[0, 0] = 1.0
        out.append((tokens, labels, mask))
    return out


def _loss_func(mask, output):
    loss = (output * mask).sum()
    return loss, mask.sum().to(torch.int64), {"lm loss": (loss.detach(), mask.sum())}


def _forward_step(data_iterator, model):
    tokens, labels, mask = next(data_iterator)
    return model(tokens, labels), partial(_loss_func, mask)


def _schedule_grads(per_token, coeff, m, loss_scale=None):
    cfg = MoEConfig(num_experts=E, moe_router_topk=K, moe_aux_loss_coeff=coeff,
                    moe_z_loss_coeff=coeff * ZC / AUX or None)
    model = _Tiny(cfg).train()
    pg = ProcessGroupCollection.world_of_one()
    sched = PipelineConfig(hidden_size=H, calculate_per_token_loss=per_token,
                           grad_scale_func=None if loss_scale is None else
                           (lambda loss: loss * loss_scale))
    data = prepare_moe_iteration(_forward_step, iter(_batches(m)), [model], moe_config=cfg,
                                 num_microbatches=m, seq_length=S, micro_batch_size=B,
                                 schedule_config=sched, pg_collection=pg)
    get_forward_backward_func(pg)(forward_step_func=_forward_step, data_iterator=data,
                                  model=[model], num_microbatches=m, seq_length=S,
                                  micro_batch_size=B, forward_only=False, config=sched,
                                  pg_collection=pg)
    tokens = sum(int(b[2].sum()) for b in _batches(m))
    finalize_model_grads([model], num_tokens=tokens if per_token else None, pg_collection=pg)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _router_losses(model, tokens, coeff):
    """Switch (eq. 4) and z (ST-MoE eq. 5) of one micro-batch, from the router's logits."""
    x = model.embed(tokens).view(-1, H)
    logits = x @ model.moe.router.weight.T
    n = logits.shape[0]
    indices = logits.topk(K, dim=-1).indices
    f = torch.stack([(indices == e).sum() for e in range(E)]).to(logits.dtype)
    aux = coeff * E / (K * n * n) * (f * torch.softmax(logits, -1).sum(0)).sum()
    z = (coeff * ZC / AUX) / n * torch.logsumexp(logits, -1).square().sum()
    return aux + z


def _oracle_grads(per_token, coeff, m):
    cfg = MoEConfig(num_experts=E, moe_router_topk=K)  # no injected loss: everything explicit
    model = _Tiny(cfg).train()
    batches = _batches(m)
    total = sum(b[2].sum() for b in batches)
    loss = 0.0
    for tokens, labels, mask in batches:
        lm = (model(tokens, labels) * mask).sum()
        loss = loss + (lm / total if per_token else lm / mask.sum() / m)
        loss = loss + _router_losses(model, tokens, coeff) / m
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("per_token", [False, True])
def test_gradient_is_the_single_process_math(per_token, m):
    got, want = _schedule_grads(per_token, AUX, m), _oracle_grads(per_token, AUX, m)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("m", [2, 3])
def test_router_losses_contribute_the_same_with_and_without_per_token_loss(m):
    """(grad with the losses - grad without them) is the same under both normalisations, and
    not zero (the router losses do reach the router)."""
    per_token = {n: g - _schedule_grads(True, 0.0, m)[n]
                 for n, g in _schedule_grads(True, AUX, m).items()}
    mean = {n: g - _schedule_grads(False, 0.0, m)[n]
            for n, g in _schedule_grads(False, AUX, m).items()}
    assert per_token["moe.router.weight"].abs().max() > 1e-4
    for name in per_token:
        torch.testing.assert_close(per_token[name], mean[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("per_token", [False, True])
def test_fp16_loss_scale_multiplies_the_router_losses_too(per_token):
    """With a grad scaler (fp16) the schedule multiplies the lm loss by the loss scale before
    backward and the step divides every gradient by it: the router losses' gradient must be
    multiplied alike, else the step shrinks it by the loss scale."""
    got, want = _schedule_grads(per_token, AUX, 2, loss_scale=1024.0), _oracle_grads(per_token, AUX, 2)
    for name in want:
        torch.testing.assert_close(got[name] / 1024.0, want[name], rtol=1e-5, atol=1e-7, msg=name)
