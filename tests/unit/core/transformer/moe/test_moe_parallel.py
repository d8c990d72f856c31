"""Expert parallelism and split token sets against the one-process layer (gloo, fp32).

EP: every rank holds its own micro-batch and E/EP experts; its outputs, input gradients and
router gradients equal the one-process layer's on that micro-batch, and its experts' gradients
equal the one-process gradients summed over the ranks' micro-batches (rtol 1e-6). Token group:
the micro-batch's sequence split over 2 ranks gives the whole micro-batch's output slice, losses
and drops; router and expert gradients summed over the group equal the one-process ones.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe import MoELayer
from tests.helpers.dist import run_distributed

H, F_EXPERT, S, B = 8, 8, 6, 2
BASE = MoEConfig(num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)


def _layer(cfg, **groups):
    return MoELayer(cfg, hidden_size=H, ffn_hidden_size=F_EXPERT, seed=11, layer_number=2,
                    init_method_std=0.3, num_layers=2, **groups).train()


def _skew(layer):
    """Every token to experts 5 and 6 (inputs get feature 0 = 10 + noise)."""
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[5, 0], layer.router.weight[6, 0] = 5.0, 4.0


def _inputs(seed, skew, s=S):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, B, H, generator=g)
    if skew:
        x[..., 0] = 10 + x[..., 0].abs()
    return x, torch.randn(s, B, H, generator=g)


def _run(layer, x, dy):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _ep_rank(cfg_kw, skew):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dataclasses.replace(BASE, **cfg_kw)
    group = dist.new_group(list(range(world)))
    layer, ref = _layer(cfg, ep_group=group), _layer(cfg)
    if skew:
        _skew(layer), _skew(ref)
    x, dy = _inputs(100 + rank, skew)
    y, dx, grads = _run(layer, x, dy)
    y_ref, dx_ref, grads_ref = _run(ref, x, dy)
    local = 8 // world
    for name in ("experts.weight1", "experts.weight2"):
        dist.all_reduce(grads_ref[name])  # the experts see every rank's tokens
        grads_ref[name] = grads_ref[name][rank * local:(rank + 1) * local]
    alltoall = cfg.moe_token_dispatcher_type == "alltoall"
    rows = sum(layer.token_dispatcher.recv_splits) if alltoall else -1
    return dict(y=(y, y_ref), dx=(dx, dx_ref), dropped=(layer.dropped_choices, ref.dropped_choices),
                losses=(layer.last_losses, ref.last_losses), rows=rows,
                grads={n: (grads[n], grads_ref[n]) for n in grads})


CASES = {
    "alltoall": dict(),
    "allgather": dict(moe_token_dispatcher_type="allgather"),
    "alltoall_grouped_capacity": dict(moe_grouped_gemm=True, moe_expert_capacity_factor=1.0),
    "alltoall_capacity_padded": dict(moe_expert_capacity_factor=1.0,
                                     moe_pad_expert_input_to_capacity=True,
                                     moe_token_drop_policy="position"),
    "allgather_capacity": dict(moe_token_dispatcher_type="allgather",
                               moe_expert_capacity_factor=1.0),
    "shared_sigmoid_bias_groups": dict(moe_router_score_function="sigmoid",
                                       moe_router_enable_expert_bias=True,
                                       moe_router_num_groups=4, moe_router_group_topk=2,
                                       moe_shared_expert_intermediate_size=4,
                                       moe_shared_expert_gate=True),
}


def _close(a, b, name):
    """rtol 1e-6 of the tensor's largest element: sums over ranks are added in another order
    (measured: at most 4.8e-7 on expert gradients of magnitude 2)."""
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()), msg=name)


def _check(results, expect_drops):
    for r in results:
        for name in ("y", "dx"):
            _close(*r[name], name)
        for name, (a, b) in r["grads"].items():
            _close(a, b, name)
        assert r["dropped"][0] == r["dropped"][1]
        assert r["losses"][0].keys() == r["losses"][1].keys() and r["losses"][0]
        for name in r["losses"][0]:
            torch.testing.assert_close(r["losses"][0][name], r["losses"][1][name], rtol=1e-6, atol=0)
    assert (sum(r["dropped"][0] for r in results) > 0) == expect_drops


def _cases_rank(runs):
    """Several cases in one world (a world costs seconds to start): ``[(case, skew)]``."""
    return [_ep_rank(CASES[case], skew) for case, skew in runs]


def _check_cases(world, runs):
    per_case = run_distributed(world, _cases_rank, runs)
    for i, (case, skew) in enumerate(runs):
        results = [rank[i] for rank in per_case]
        _check(results, "capacity" in case)
        if skew and case == "alltoall":  # experts 5, 6 on the last ranks: the first get no row
            tokens = S * B * world  # every rank's tokens, each choosing experts 5 and 6
            expected = [0, 2 * tokens] if world == 2 else [0, 0, tokens, tokens]
            assert [r["rows"] for r in results] == expected


def test_ep2_equals_one_process():
    _check_cases(2, [(case, False) for case in sorted(CASES)] + [("alltoall", True)])


def test_ep4_equals_one_process_and_skewed_router_with_zero_token_ranks():
    _check_cases(4, [("alltoall", False), ("allgather", False),
                     ("alltoall_grouped_capacity", False), ("alltoall", True),
                     ("allgather", True), ("alltoall_capacity_padded", True)])


def _token_group_rank(cfg_kw):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dataclasses.replace(BASE, **cfg_kw)
    group = dist.new_group(list(range(world)))
    layer, ref = _layer(cfg, token_group=group), _layer(cfg)
    x, dy = _inputs(7, False, s=S * world)  # the whole micro-batch, the same on every rank
    part = slice(rank * S, (rank + 1) * S)
    y, dx, grads = _run(layer, x[part], dy[part])
    y_ref, dx_ref, grads_ref = _run(ref, x, dy)
    for g in grads.values():
        dist.all_reduce(g)  # gradients of a split token set: summed over the group
    return dict(y=(y, y_ref[part]), dx=(dx, dx_ref[part]),
                dropped=(torch.tensor(layer.dropped_choices), ref.dropped_choices),
                losses=(layer.last_losses, ref.last_losses),
                grads={n: (grads[n], grads_ref[n]) for n in grads})


SPLIT_CASES = [dict(moe_expert_capacity_factor=1.0),
               dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position"),
               dict(moe_router_load_balancing_type="seq_aux_loss")]


def _token_group_cases(cases):
    return [_token_group_rank(kw) for kw in cases]


def test_split_token_set_equals_whole_micro_batch():
    per_case = run_distributed(2, _token_group_cases, SPLIT_CASES)
    for i, cfg_kw in enumerate(SPLIT_CASES):
        results = [rank[i] for rank in per_case]
        dropped = sum(int(r["dropped"][0]) for r in results)
        for r in results:
            r["dropped"] = (dropped, r["dropped"][1])
        _check(results, "moe_expert_capacity_factor" in cfg_kw)


def _fold_rank(cases):
    """4 ranks: micro-batch A split over ranks 0, 1 and B over 2, 3 (the token groups); EP = 2
    over {0, 2} and {1, 3}, so experts 0-3 live on ranks 0, 1 and 4-7 on ranks 2, 3 (their
    expert-data-parallel groups are {0, 1} and {2, 3}): router gradients summed over the token
    group equal one process's on the micro-batch, expert gradients summed over expert-DP equal
    one process's summed over A and B."""
    rank = dist.get_rank()
    tokens = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    eps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    token_group, ep_group = tokens[rank // 2], eps[rank % 2]
    expert_dp = tokens[rank // 2]  # the ranks holding the same experts: {0, 1} and {2, 3}
    out = []
    for cfg_kw in cases:
        cfg = dataclasses.replace(BASE, **cfg_kw)
        layer = _layer(cfg, ep_group=ep_group, token_group=token_group)
        ref = _layer(cfg)
        x, dy = _inputs(40 + rank // 2, False, s=2 * S)  # micro-batch A or B
        part = slice((rank % 2) * S, (rank % 2 + 1) * S)
        y, dx, grads = _run(layer, x[part], dy[part])
        y_ref, dx_ref, grads_ref = _run(ref, x, dy)
        dist.all_reduce(grads["router.weight"], group=token_group)
        first = (rank // 2) * 4  # EP rank rank // 2
        for name in ("experts.weight1", "experts.weight2"):
            dist.all_reduce(grads[name], group=expert_dp)
            dist.all_reduce(grads_ref[name], group=ep_group)  # micro-batches A + B
            grads_ref[name] = grads_ref[name][first:first + 4]
        dropped = torch.tensor(layer.dropped_choices)
        dist.all_reduce(dropped, group=token_group)
        out.append(dict(y=(y, y_ref[part]), dx=(dx, dx_ref[part]),
                        dropped=(int(dropped), ref.dropped_choices),
                        losses=(layer.last_losses, ref.last_losses),
                        grads={n: (grads[n], grads_ref[n]) for n in grads}))
    return out


FOLD_CASES = [dict(moe_expert_capacity_factor=1.0),
              dict(moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0)]


def test_ep2_folded_over_split_token_sets_equals_one_process():
    per_case = run_distributed(4, _fold_rank, FOLD_CASES)
    for i in range(len(FOLD_CASES)):
        _check([rank[i] for rank in per_case], True)


def _global_aux_rank():
    rank = dist.get_rank()
    cfg = dataclasses.replace(BASE, moe_router_load_balancing_type="global_aux_loss")
    layer = _layer(cfg, dp_group=dist.new_group([0, 1]))
    both = [_inputs(60 + r, False)[0] for r in range(2)]
    layer(both[rank])
    ref_own, ref_all = _layer(cfg), _layer(dataclasses.replace(
        cfg, moe_router_load_balancing_type="aux_loss"))
    ref_own(both[rank])
    ref_all(torch.cat(both, dim=1))  # the two micro-batches as one token set
    return layer.last_losses, ref_own.last_losses, ref_all.last_losses


def test_global_aux_loss_spans_the_data_parallel_micro_batches():
    for got, own, whole in run_distributed(2, _global_aux_rank):
        torch.testing.assert_close(got["global_load_balancing_loss"], whole["load_balancing_loss"],
                                   rtol=1e-6, atol=0)
        torch.testing.assert_close(got["z_loss"], own["z_loss"], rtol=0, atol=0)  # per micro-batch
