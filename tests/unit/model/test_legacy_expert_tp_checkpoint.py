"""Legacy checkpoints (``--ckpt-format torch``) of experts split over expert-TP, loaded at another
expert-TP and EP.

tests/unit/model/test_expert_checkpoint.py's MoE layer (4 experts, top-2, shared expert, expert
bias) in DDP with the distributed optimizer, trained 3 steps at (EP, expert-TP) on TP = 1, so
expert-TP > 1 is other than TP and each ``mp_rank_00[_EEE]`` file holds whole experts (gathered
over expert-TP at the save); the optimizer shards hold each rank's expert-TP slice. Saved at one
layout and loaded at another. Oracle: every rank's weights and distributed-optimizer records (fp32
main values, Adam moments) put into whole experts by the slice index of each expert-TP rank
(``_slice``: ``[gate_t; up_t]`` rows of ``weight1``, columns ``f_t`` of ``weight2``), each element
held exactly once over the ranks; the saving and the loading world's are bitwise equal, expert by
expert (all E present and distinct).
"""

import os

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.unit.model.test_expert_checkpoint import E, _build, _slice, _train

SHAPES = {"experts.weight1": (E, 12, 8), "experts.weight2": (E, 8, 6)}  # [E, 2F, H], [E, H, F]


def _state(ddp, opt, groups, params=None):
    """This rank's ``(records, weights, (expert-TP rank, size), first expert, E_local)``:
    its distributed-optimizer records (local ranges; or ``params``) and weights by name."""
    params = opt.parameter_state()["params"] if params is None else params
    weights = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    local = ddp.module.experts.num_local_experts
    return (params, weights, (groups.expt_tp.rank, groups.expt_tp.size),
            groups.ep.rank * local, local)


def _save(save_dir, ep, etp, distributed=True):
    from megatron.checkpointing import save_checkpoint
    from megatron.config.checkpoint import CheckpointConfig

    groups, _, ddp, opt = _build(ep, distributed, etp=etp)
    _train(groups, ddp, opt)
    save_checkpoint(3, [ddp], opt, None, CheckpointConfig(save=save_dir), groups,
                    run_flags={"expert_model_parallel_size": ep,
                               "expert_tensor_parallel_size": etp},
                    consumed_train_samples=0, consumed_valid_samples=0)
    return _state(ddp, opt, groups) if distributed else None


def _load(save_dir, ep, etp, distributed=True):
    from megatron.checkpointing import load_checkpoint
    from megatron.config.checkpoint import CheckpointConfig

    from megatron.core.dist_checkpointing.checkpoint_io import CheckpointUsageError

    groups, layer, ddp, opt = _build(ep, distributed, etp=etp)
    try:
        load_checkpoint([ddp], opt, None, CheckpointConfig(load=save_dir), groups, run_flags={})
    except CheckpointUsageError as exc:
        return "refused", str(exc)
    if distributed:
        return _state(ddp, opt, groups)
    records = {}  # the plain optimizer's state as records covering each tensor whole
    for part in opt.parts:
        for group in part.optimizer.param_groups:
            for p in group["params"]:
                name = next(n for n, q in layer.named_parameters() if q is p)
                state = part.optimizer.state[p]
                records[f"0.{name}"] = {"range": [0, p.numel()],
                                        "param": p.detach().reshape(-1).clone(),
                                        **{k: state[k].reshape(-1).clone()
                                           for k in ("exp_avg", "exp_avg_sq")}}
    return _state(ddp, opt, groups, records)


def _whole(per_rank):
    """``({name: {key: whole tensor}}, {name: weight})`` of all ranks: expert tensors as whole
    ``[E, ...]`` experts, each element of the optimizer records covered exactly once over the
    ranks, weight replicas asserted equal."""
    from megatron.core.optimizer.distrib_optimizer_checkpoint import STATE_KEYS

    records, weights, count = {}, {}, {}
    for params, held, (u, k), first, local in per_rank:
        for name, rec in params.items():
            name = name.split(".", 1)[1]  # "<chunk>.<name>"
            if name in SHAPES:  # into whole experts through the slice's index
                shape = (local, *_slice_shape(name, k))
                out = records.setdefault(name, {key: torch.zeros(SHAPES[name])
                                                for key in STATE_KEYS})
                seen = count.setdefault(name, torch.zeros(SHAPES[name], dtype=torch.int64))
                s, t = rec["range"]
                for key in STATE_KEYS:
                    flat = torch.full((local * shape[1] * shape[2],), float("nan"))
                    flat[s:t] = rec[key].reshape(-1)
                    piece = flat.view(shape)
                    for i in range(local):
                        have = ~piece[i].isnan()
                        target = out[key][first + i][_slice(name, u, k)]
                        target[have] = piece[i][have]
                        out[key][first + i][_slice(name, u, k)] = target
                        if key == "param":
                            c = seen[first + i][_slice(name, u, k)]
                            c[have] += 1
                            seen[first + i][_slice(name, u, k)] = c
            else:
                n = held[name].numel()
                out = records.setdefault(name, {key: torch.zeros(n) for key in STATE_KEYS})
                seen = count.setdefault(name, torch.zeros(n, dtype=torch.int64))
                s, t = rec["range"]
                for key in STATE_KEYS:
                    out[key][s:t] = rec[key].reshape(-1)
                seen[s:t] += 1
        for name, p in held.items():
            if name in SHAPES:
                for i in range(local):
                    whole = weights.setdefault((name, first + i),
                                               torch.full(SHAPES[name][1:], float("nan")))
                    at = _slice(name, u, k)
                    if not whole[at].isnan().all():
                        assert torch.equal(whole[at], p[i]), (name, first + i)
                    whole[at] = p[i]
            else:
                if name in weights:
                    assert torch.equal(weights[name], p), name
                weights[name] = p
    for name, c in count.items():
        assert bool((c == 1).all()), name  # each element held by exactly one rank
    for key, w in weights.items():
        assert not w.isnan().any(), key
    return records, weights


def _slice_shape(name, k):
    _, a, b = SHAPES[name]
    return (a // k, b) if name.endswith("weight1") else (a, b // k)


@pytest.mark.parametrize("save, save_world, load, load_world", [
    ((2, 2), 4, (1, 1), 2), ((2, 2), 4, (4, 1), 4), ((1, 2), 2, (2, 1), 2),
    ((1, 1), 2, (2, 2), 4), ((1, 2), 4, (2, 2), 4)],
    ids=["ep2etp2-to-ep1etp1", "ep2etp2-to-ep4", "etp2dp2-to-ep2", "ep1dp2-to-ep2etp2",
         "etp2dp4-to-ep2etp2"])
def test_legacy_experts_load_at_another_expert_tp_bitwise(tmp_path, save, save_world, load,
                                                          load_world):
    _check(str(tmp_path / "ckpt"), save, save_world, load, load_world)


def test_legacy_distributed_optimizer_at_expert_tp2_loads_into_the_plain_optimizer(tmp_path):
    """Saved at EP 2 x expert-TP 2 (distributed optimizer), loaded by one process's plain
    optimizer: its state is the shards' records re-cut to whole experts."""
    _check(str(tmp_path / "ckpt"), (2, 2), 4, (1, 1), 1, distributed=False)


def _check(folder, save, save_world, load, load_world, distributed=True):
    saved = run_distributed(save_world, _save, folder, *save)
    loaded = run_distributed(load_world, _load, folder, *load, distributed)
    a, wa = _whole(saved)
    b, wb = _whole(loaded)
    assert a.keys() == b.keys() and wa.keys() == wb.keys()
    for name in a:
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)
        assert a[name]["exp_avg"].abs().sum() > 0, name  # trained: moments are not zeros
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    sums = {wb[("experts.weight1", e)].double().sum().item() for e in range(E)}
    assert len(sums) == E  # every expert present and distinct
    if save[1] > 1:  # expert-TP > TP = 1: each file holds whole experts
        step = os.path.join(folder, "iter_0000003")
        for sub in os.listdir(step):
            state = torch.load(os.path.join(step, sub, "model_optim_rng.pt"), weights_only=True)
            assert state["expert_tensor_slice"] == [0, 1]
            assert state["model"]["experts.weight1"].shape == (E // save[0], 12, 8)


def test_legacy_plain_optimizer_at_another_expert_tp_is_refused_in_one_line(tmp_path):
    """The plain optimizer's state holds the expert-TP slices by position (training refuses to
    save it at expert-TP other than TP; here saved at expert-TP 2 = the slices' layout of the
    state): loading it at expert-TP 1 is refused, naming the saved layout and the fixes."""
    folder = str(tmp_path / "ckpt")
    run_distributed(2, _save, folder, 1, 2, False)
    kind, message = run_distributed(1, _load, folder, 1, 1, False)[0]
    assert kind == "refused" and "\n" not in message
    assert "--expert-tensor-parallel-size 2" in message and "--no-load-optim" in message
