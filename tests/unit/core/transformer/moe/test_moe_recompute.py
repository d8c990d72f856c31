"""Selective recompute inside the MoE layer (``--recompute-modules moe_act``, ``moe``,
``shared_experts``; Megatron-Core's names) against the same layer without recompute (fp32):

- output, input gradient and every parameter gradient bitwise equal (the replay runs the same
  kernels on the same inputs), with the grouped kernel and the per-expert loop, at EP = 1 and
  EP = 2 (alltoall, capacity 1.0 with drops and without);
- the logged router losses, the routing counts and the forward count as without recompute (the
  ``moe`` replay records nothing: ``is_recomputing``);
- the bytes kept for backward (``saved_tensors_hooks``) smaller by exactly the recomputed
  tensors: ``moe_act`` the activations ``[rows, f]`` (rows = kept choices), ``shared_experts``
  the shared expert's ``gate_up [T, 2 f_s]`` and activation ``[T, f_s]``; under ``moe`` the layer
  keeps its input ``[s, b, h]`` and nothing else.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.moe.moe_config import MoEConfig
from tests.helpers.activation_memory import saved_activation_bytes
from tests.helpers.dist import run_distributed

H, F_EXPERT, F_SHARED, S, B = 8, 12, 16, 6, 2
BASE = MoEConfig(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                 moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=F_SHARED)
CASES = {"loop": {}, "grouped": {"moe_grouped_gemm": True},
         "capacity": {"moe_expert_capacity_factor": 1.0, "moe_grouped_gemm": True}}
MODULES = [(), ("moe_act",), ("shared_experts",), ("moe",), ("moe_act", "shared_experts")]


def _layer(cfg, modules, ep_group=None):
    return MoELayer(cfg, hidden_size=H, ffn_hidden_size=F_EXPERT, seed=5, layer_number=1,
                    init_method_std=0.3, num_layers=2, ep_group=ep_group,
                    recompute_modules=frozenset(modules)).train()


def _run(layer, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=g).requires_grad_()
    dy = torch.randn(S, B, H, generator=g)
    params = list(layer.parameters())
    y, saved = saved_activation_bytes(lambda: layer(x), exclude=params)
    y.backward(dy)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    record = (dict(layer.loss_sums), layer.num_forwards, layer.routed_counts.clone(),
              int(layer.dropped_count))
    return y.detach(), x.grad, grads, record, saved


def _expected_saving(modules, rows):
    """Bytes the modules spare (fp32), from the shapes alone."""
    out = 0
    if "moe_act" in modules:
        out += rows * F_EXPERT * 4
    if "shared_experts" in modules:
        out += S * B * 3 * F_SHARED * 4
    return out


def _compare(case, ep_group=None, seed=0):
    """For each module set: (equal in every bit?, saved bytes, rows of the local experts)."""
    cfg = dataclasses.replace(BASE, **CASES[case])
    plain = _run(_layer(cfg, (), ep_group), seed)
    y, dx, grads, record, saved = plain
    out = {}
    for modules in MODULES[1:]:
        layer = _layer(cfg, modules, ep_group)
        got = _run(layer, seed)
        rows = int(layer.tokens_per_expert.sum())  # this rank's experts' rows (no padding)
        losses, forwards, routed, dropped = got[3]
        same = (torch.equal(got[0], y) and torch.equal(got[1], dx)
                and all(torch.equal(got[2][n], grads[n]) for n in grads)
                and losses.keys() == record[0].keys()
                and all(torch.equal(losses[k], record[0][k]) for k in losses)
                and forwards == record[1] == 1 and torch.equal(routed, record[2])
                and dropped == record[3])
        out[modules] = (same, saved - got[4], rows, saved)
    return out


def _check(results):
    for modules, (same, spared, rows, saved) in results.items():
        assert same, modules
        if "moe" in modules:
            assert saved - spared == S * B * H * 4, modules  # only the input is kept
        else:
            assert spared == _expected_saving(modules, rows), (modules, spared, rows)


@pytest.mark.parametrize("case", list(CASES))
def test_recompute_is_bitwise_and_spares_the_exact_bytes(case):
    _check(_compare(case))


def _ep_rank(case):
    group = dist.new_group(list(range(dist.get_world_size())))
    return _compare(case, ep_group=group, seed=10 + dist.get_rank())


@pytest.mark.parametrize("case", ["grouped", "capacity"])
def test_recompute_at_ep2_is_bitwise_and_spares_the_exact_bytes(case):
    for results in run_distributed(2, _ep_rank, case):
        _check(results)
