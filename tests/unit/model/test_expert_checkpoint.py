"""torch_dist checkpoints of a mixture-of-experts layer on a global expert axis.

A :class:`MoELayer` (4 experts, top-2, shared expert, expert bias) wrapped in DDP with its expert
weights marked, trained 3 steps with the chained optimizer (dense and expert parts, plain or
distributed) on rank-dependent tokens, is saved at one expert-parallel size (and expert-TP size)
and loaded at another.
Oracles: the checkpoint's global tensors reassembled in one process, compared (a) expert by expert
with the weights and Adam moments each EP rank held when it saved, and (b) with the global tensors
of a checkpoint saved again right after loading at the new layout: weights, Adam moments and the
expert bias bitwise.
"""

import os

import pytest
import torch

from megatron.core import dist_checkpointing as dcp
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.distributed.expert_params import mark_expert
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.model.sharded_state import model_sharded_tensors, model_shardings
from tests.helpers.dist import run_distributed

E, H, F = 4, 8, 6
CFG = MoEConfig(num_experts=E, moe_ffn_hidden_size=F, moe_router_topk=2,
                moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                moe_shared_expert_intermediate_size=4)
EXPERT_KEYS = ("experts.weight1", "experts.weight2")


def _build(ep: int, distributed: bool, groups=None, etp: int = 1):
    if groups is None:
        groups = ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep,
                                              expert_tensor_parallel_size=etp)
    layer = MoELayer(CFG, hidden_size=H, seed=5, layer_number=1,
                     ep_group=groups.ep.group if ep > 1 else None,
                     expert_tp_group=groups.expt_tp.group if etp > 1 else None)
    for p in layer.experts.parameters():
        mark_expert(p)
    ddp = DistributedDataParallel(layer, data_parallel_group=groups.dp_cp.group,
                                  expert_data_parallel_group=groups.expt_dp.group,
                                  use_distributed_optimizer=distributed)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, use_distributed_optimizer=distributed)
    return groups, layer, ddp, get_megatron_optimizer(config, [ddp], pg_collection=groups)


def _train(groups, ddp, opt, steps=3):
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for step in range(steps):
        x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        finalize_model_grads([ddp], pg_collection=groups)
        opt.step()
    ddp.finish_param_sync()


def _boxes(groups, ddp, opt, saved=None):
    """The boxes to save (saved None) or to fill from a checkpoint holding ``saved`` keys."""
    boxes = model_sharded_tensors([ddp], groups)
    shardings = model_shardings([ddp], groups)
    state = (opt.sharded_state_dict(shardings) if saved is None
             else opt.sharded_load_targets(shardings, saved))
    if saved is None:
        return dcp.balance_writers_by_group(boxes + state.replicated, groups.rank) + state.owned, \
            state
    return boxes + state.replicated + state.owned, state


def _save(folder, groups, ddp, opt):
    boxes, state = _boxes(groups, ddp, opt)
    dcp.save(boxes, folder)
    if groups.rank == 0:
        torch.save(state.common, os.path.join(folder, "optimizer_common.pt"))


def _slice(name, rank, size):
    """The index, in one global expert ``[2F, H]`` / ``[H, F]``, of expert-TP rank ``rank``'s
    slice of ``name`` (``weight1``: ``[gate_t; up_t]`` rows, ``weight2``: columns ``f_t``)."""
    f = F // size
    cols = torch.arange(rank * f, (rank + 1) * f)
    if name.endswith("weight1"):
        return (torch.cat([cols, F + cols]),)
    return (slice(None), cols)


def _held(layer, opt, groups):
    """``{(key, global expert, expert-TP rank, expert-TP size): tensor}`` of this rank's
    experts (its expert-TP slice of each): weights, and the plain optimizer's Adam moments (the
    distributed one holds pieces)."""
    out = {}
    tp = (groups.expt_tp.rank, groups.expt_tp.size)
    first = groups.ep.rank * layer.experts.num_local_experts  # MoELayer: rank r, experts r E/EP..
    mains = dict(opt.parts[1].model_main_pairs()) if hasattr(opt.parts[1], "model_main_pairs") \
        else {}
    for name in ("weight1", "weight2"):
        p = getattr(layer.experts, name)
        state = opt.parts[1].optimizer.state.get(mains.get(p), {}) if p in mains else {}
        for i in range(p.shape[0]):
            out[(f"model.experts.{name}", first + i, *tp)] = p.detach()[i].clone()
            for moment in ("exp_avg", "exp_avg_sq"):
                if moment in state:
                    out[(f"optimizer.state.{moment}.experts.{name}", first + i, *tp)] = \
                        state[moment][i].clone()
    return out


def _save_at(folder, ep, distributed, etp=1):
    groups, layer, ddp, opt = _build(ep, distributed, etp=etp)
    with torch.no_grad():  # a state of its own, the same on every rank
        layer.router.expert_bias.copy_(torch.arange(E, dtype=torch.float32) * 0.25 - 0.3)
    _train(groups, ddp, opt)
    _save(folder, groups, ddp, opt)
    torch.distributed.barrier()
    return _held(layer, opt, groups)


def _load_and_resave(folder, again, ep, distributed, etp=1):
    groups, layer, ddp, opt = _build(ep, distributed, etp=etp)
    saved = set(dcp.tensor_shapes(dcp.read_metadata(folder)))
    boxes, targets = _boxes(groups, ddp, opt, saved)
    dcp.load(boxes, folder)
    targets.finish(torch.load(os.path.join(folder, "optimizer_common.pt"), weights_only=True))
    _save(again, groups, ddp, opt)
    torch.distributed.barrier()
    return _held(layer, opt, groups)


def _global_tensors(folder):
    """Every tensor of the checkpoint, whole (read in one process)."""
    shapes = dcp.tensor_shapes(dcp.read_metadata(folder))
    boxes = [dcp.ShardedTensor(k, torch.zeros(s, dtype=d), s, (0,) * len(s))
             for k, (s, d) in shapes.items() if not k.startswith("__")]
    dcp.load(boxes, folder, single_process=True)
    return {b.key: b.data for b in boxes}


def _check_every_expert(tensors, held_by_rank, ep):
    """Each EP rank's experts are rows of the global tensor at their global index (an expert-TP
    rank's slice: its rows / columns of the row, :func:`_slice`); all E rows are there (each
    held by exactly one EP rank's boxes) and distinct."""
    seen = set()
    for held in held_by_rank:
        for (key, expert, t, size), value in held.items():
            assert torch.equal(tensors[key][expert][_slice(key, t, size)], value), (key, expert)
            seen.add((key, expert))
    for key in EXPERT_KEYS:
        assert {e for k, e in seen if k == "model." + key} == set(range(E))
        g = tensors["model." + key]
        assert g.shape[0] == E
        sums = [g[e].double().sum().item() for e in range(E)]
        assert len(set(sums)) == E  # four different experts, not one rank's copied
    assert len(held_by_rank) >= ep


@pytest.mark.parametrize("save_ep,load_ep,distributed", [
    (2, 1, False), (2, 1, True), (1, 4, False), (1, 4, True)],
    ids=["ep2-to-ep1", "ep2-to-ep1-distopt", "ep1-to-ep4", "ep1-to-ep4-distopt"])
def test_saved_at_one_ep_loads_at_another_bitwise(tmp_path, save_ep, load_ep, distributed):
    first, again = str(tmp_path / "first"), str(tmp_path / "again")
    os.makedirs(first)
    os.makedirs(again)
    held = run_distributed(max(save_ep, 2), _save_at, first, save_ep, distributed)
    a = _global_tensors(first)
    _check_every_expert(a, held, save_ep)
    loaded = run_distributed(max(load_ep, 2), _load_and_resave, first, again, load_ep,
                             distributed)
    _check_every_expert(a, loaded, load_ep)  # what each new EP rank holds is the saved expert
    b = _global_tensors(again)
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(a["model.router.expert_bias"],
                       torch.arange(E, dtype=torch.float32) * 0.25 - 0.3)
    moments = [k for k in a if k.startswith("optimizer.state.exp_avg")]
    assert {k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1] for k in moments} >= \
        {"experts.weight1", "experts.weight2", "router.weight"}
    assert all(a[k].abs().sum() > 0 for k in moments)  # trained: the moments are not zeros


@pytest.mark.parametrize("save,load,distributed", [
    ((2, 2), (1, 1), False), ((2, 2), (1, 1), True), ((2, 2), (4, 1), True),
    ((1, 1), (2, 2), True), ((1, 2), (2, 1), False)],
    ids=["ep2etp2-to-ep1etp1", "ep2etp2-to-ep1etp1-distopt", "ep2etp2-to-ep4etp1-distopt",
         "ep1etp1-to-ep2etp2-distopt", "ep1etp2-to-ep2etp1"])
def test_saved_at_one_expert_tp_loads_at_another_bitwise(tmp_path, save, load, distributed):
    """torch_dist at expert-TP > 1: each expert-TP rank's slice lands in the global expert
    tensors an expert-TP 1 run saves (every expert's slices compared with what each rank held),
    and a checkpoint saved at one (EP, expert-TP) and loaded at another is saved again with the
    same global tensors: weights, Adam moments (plain, or the distributed optimizer's pieces) and
    the expert bias bitwise."""
    (save_ep, save_etp), (load_ep, load_etp) = save, load
    first, again = str(tmp_path / "first"), str(tmp_path / "again")
    os.makedirs(first)
    os.makedirs(again)
    held = run_distributed(max(save_ep * save_etp, 2), _save_at, first, save_ep, distributed,
                           save_etp)
    a = _global_tensors(first)
    assert a["model.experts.weight1"].shape == (E, 2 * F, H)  # as at expert-TP 1
    assert a["model.experts.weight2"].shape == (E, H, F)
    _check_every_expert(a, held, save_ep)
    loaded = run_distributed(max(load_ep * load_etp, 2), _load_and_resave, first, again, load_ep,
                             distributed, load_etp)
    _check_every_expert(a, loaded, load_ep)
    b = _global_tensors(again)
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    moments = [k for k in a if k.startswith("optimizer.state.exp_avg") and ".experts.w" in k]
    assert len(moments) == 4 and all(a[k].abs().sum() > 0 for k in moments)


@pytest.mark.parametrize("ep", [2, 4])
def test_every_expert_is_saved_from_the_rank_holding_it(tmp_path, ep):
    """EP never saves one rank's experts only: each of the E experts' saved values (weights and
    Adam moments) equal those of the EP rank that held it (checksum per expert)."""
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    held = run_distributed(ep, _save_at, folder, ep, False)
    tensors = _global_tensors(folder)
    _check_every_expert(tensors, held, ep)
    for key in ("optimizer.state.exp_avg.experts.weight1", "optimizer.state.exp_avg_sq."
                "experts.weight2"):
        assert {k[1] for k in set().union(*map(set, held)) if k[0] == key} == set(range(E))


# The legacy format (--ckpt-format torch): one mp_rank_TT[_PPP]_EEE file per EP rank ---------------

def _legacy(save_dir, ep, distributed):
    """Train, save (legacy), keep training one step; a fresh model loads the checkpoint and takes
    the same step. Returns this rank's held experts at the save, the files' expert weights, the
    loaded model's, and both runs' weights after the step."""
    from megatron.checkpointing import (CheckpointError, checkpoint_name_of, load_checkpoint,
                                        save_checkpoint)
    from megatron.config.checkpoint import CheckpointConfig

    groups, layer, ddp, opt = _build(ep, distributed)
    _train(groups, ddp, opt)
    config = CheckpointConfig(save=save_dir, load=save_dir)
    try:
        save_checkpoint(3, [ddp], opt, None, config, groups, run_flags={},
                        consumed_train_samples=0, consumed_valid_samples=0)
    except CheckpointError as exc:
        return "refused", str(exc)
    held = _held(layer, opt, groups)
    path = checkpoint_name_of(save_dir, 3, groups)
    in_file = torch.load(path, weights_only=True)["model"]
    _train(groups, ddp, opt, steps=1)
    after = {n: p.detach().clone() for n, p in layer.named_parameters()}
    groups, layer, ddp, opt = _build(ep, distributed, groups)
    load_checkpoint([ddp], opt, None, config, groups, run_flags={})
    loaded = _held(layer, opt, groups)
    _train(groups, ddp, opt, steps=1)
    resumed = {n: p.detach().clone() for n, p in layer.named_parameters()}
    return os.path.relpath(path, save_dir), held, in_file, loaded, after, resumed


@pytest.mark.parametrize("ep", [2, 4])
def test_legacy_files_hold_each_ep_ranks_experts_and_resume_bitwise(tmp_path, ep):
    out = run_distributed(ep, _legacy, str(tmp_path / "ckpt"), ep, False)
    names = [o[0] for o in out]
    # Megatron-LM's get_checkpoint_name: mp_rank_TT[_PPP], then _EEE at EP > 1 (PP = 1 here)
    assert names == [os.path.join("iter_0000003", f"mp_rank_00_{r:03d}", "model_optim_rng.pt")
                     for r in range(ep)]
    for rank, (_, held, in_file, loaded, after, resumed) in enumerate(out):
        local = E // ep
        for name in ("weight1", "weight2"):
            for i in range(local):  # the file holds this EP rank's experts, in local order
                key = (f"model.experts.{name}", rank * local + i, 0, 1)
                assert torch.equal(in_file[f"experts.{name}"][i], held[key])
        assert held.keys() == loaded.keys() and any("exp_avg" in k[0] for k in held)
        for key in held:  # weights and Adam moments as saved
            assert torch.equal(held[key], loaded[key]), key
        for n in after:  # the step after the load is the uninterrupted run's
            assert torch.equal(after[n], resumed[n]), n
    experts = torch.cat([o[2]["experts.weight1"] for o in out])
    assert len({experts[e].double().sum().item() for e in range(E)}) == E


def _optimizer_state(ddp, opt, groups):
    """This rank's distributed-optimizer records with expert ranges on the global expert axis,
    and its model weights: ``({name: [record]}, {(name, global expert or None): tensor})``."""
    from megatron.core.optimizer.distrib_optimizer_checkpoint import (expert_ranges,
                                                                      to_global_ranges)

    state = to_global_ranges(opt.parameter_state(), expert_ranges([ddp], groups.ep.rank))
    weights = {}
    for n, p in ddp.module.named_parameters():
        if n.startswith("experts."):
            first = groups.ep.rank * p.shape[0]
            weights.update({(n, first + i): p.detach()[i].clone() for i in range(p.shape[0])})
        else:
            weights[(n, None)] = p.detach().clone()
    return state["params"], weights


def _legacy_save_at(save_dir, ep, distributed=True):
    from megatron.checkpointing import save_checkpoint
    from megatron.config.checkpoint import CheckpointConfig

    groups, layer, ddp, opt = _build(ep, distributed)
    _train(groups, ddp, opt)
    # the args a run records (they say what mp_rank_00_001 names: an expert rank here)
    save_checkpoint(3, [ddp], opt, None, CheckpointConfig(save=save_dir), groups,
                    run_flags={"expert_model_parallel_size": ep},
                    consumed_train_samples=0, consumed_valid_samples=0)
    return _optimizer_state(ddp, opt, groups) if distributed else _held_plain(layer, opt, groups)


def _legacy_load_at(save_dir, ep, distributed):
    from megatron.core.dist_checkpointing.checkpoint_io import CheckpointUsageError
    from megatron.checkpointing import load_checkpoint
    from megatron.config.checkpoint import CheckpointConfig

    groups, layer, ddp, opt = _build(ep, distributed)
    try:
        load_checkpoint([ddp], opt, None, CheckpointConfig(load=save_dir), groups, run_flags={})
    except CheckpointUsageError as exc:
        return "refused", str(exc)
    if distributed:
        return _optimizer_state(ddp, opt, groups)
    return _held_plain(layer, opt, groups)


def _held_plain(layer, opt, groups):
    """A plain optimizer's weights and Adam moments as records covering whole tensors on the
    global expert axis (the distributed optimizer's record form), and the weights."""
    records, weights = {}, {}
    for part in opt.parts:
        for group in part.optimizer.param_groups:
            for p in group["params"]:
                name = next(n for n, q in layer.named_parameters() if q is p)
                offset = groups.ep.rank * p.numel() if name.startswith("experts.") else 0
                state = part.optimizer.state[p]
                records[f"0.{name}"] = {"range": [offset, offset + p.numel()],
                                        "param": p.detach().reshape(-1).clone(),
                                        "exp_avg": state["exp_avg"].reshape(-1).clone(),
                                        "exp_avg_sq": state["exp_avg_sq"].reshape(-1).clone()}
    for n, p in layer.named_parameters():
        if n.startswith("experts."):
            first = groups.ep.rank * p.shape[0]
            weights.update({(n, first + i): p.detach()[i].clone() for i in range(p.shape[0])})
        else:
            weights[(n, None)] = p.detach().clone()
    return records, weights


def _whole(per_rank, replicas):
    """The records of all ranks assembled into whole flattened tensors, every element covered
    exactly once (expert ranges are global: two EP ranks' experts never overlap) or, with
    ``replicas`` (a plain optimizer: every DP rank holds its whole tensors), at least once; the
    weights of all ranks (replicas asserted equal)."""
    from megatron.core.optimizer.distrib_optimizer_checkpoint import STATE_KEYS

    ranges, weights = {}, {}
    for records, held in per_rank:
        for name, rec in records.items():
            ranges.setdefault(name, []).append(rec)
        for key, value in held.items():
            if key in weights:
                assert torch.equal(weights[key], value), key
            weights[key] = value
    out = {}
    for name, recs in ranges.items():
        end = max(r["range"][1] for r in recs)
        count = torch.zeros(end, dtype=torch.int64)
        values = {k: torch.zeros(end) for k in STATE_KEYS}
        for r in recs:
            s, t = r["range"]
            count[s:t] += 1
            for k in STATE_KEYS:
                values[k][s:t] = r[k].reshape(-1)
        if replicas:
            assert (count >= 1).all(), name
        else:
            assert (count == 1).all(), name  # each element held by exactly one rank
        out[name] = values
    return out, weights


@pytest.mark.parametrize("save_ep,save_world,load_ep,load_world", [
    (2, 4, 4, 4), (2, 4, 1, 2), (2, 4, 2, 2), (1, 2, 2, 4)],
    ids=["ep2dp4-to-ep4", "ep2dp4-to-ep1dp2", "ep2dp4-to-ep2dp2", "ep1dp2-to-ep2dp4"])
def test_legacy_distributed_optimizer_loads_at_another_ep_bitwise(tmp_path, save_ep, save_world,
                                                                  load_ep, load_world):
    """The legacy format with --use-distributed-optimizer at EP > 1: every rank's shard in its
    mp_rank_TT_EEE folder, expert records on the global expert axis. Saved at one (EP, DP) and
    loaded at another: the weights (expert by expert) and the fp32 main values and Adam moments
    of every element equal the saving world's, bitwise."""
    folder = str(tmp_path / "ckpt")
    saved = run_distributed(save_world, _legacy_save_at, folder, save_ep)
    loaded = run_distributed(load_world, _legacy_load_at, folder, load_ep, True)
    a, wa = _whole(saved, False)
    b, wb = _whole(loaded, False)
    assert a.keys() == b.keys() and wa.keys() == wb.keys()
    for name in a:
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), (name, k)
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    assert {e for (n, e) in wb if n == "experts.weight1"} == set(range(E))
    assert len({wb[("experts.weight1", e)].double().sum().item() for e in range(E)}) == E
    assert all(a[n]["exp_avg"].abs().sum() > 0 for n in a)  # trained: moments are not zeros
    if save_ep > 1:
        names = sorted(os.listdir(os.path.join(folder, "iter_0000003")))
        assert names == [f"mp_rank_00_{r:03d}" for r in range(save_ep)]
        per_folder = [sorted(os.listdir(os.path.join(folder, "iter_0000003", n))) for n in names]
        # the DP x CP ranks' shards spread over the EP folders, each rank's in its own
        assert sum(len(f) - 1 for f in per_folder) == save_world


def test_legacy_distributed_optimizer_loads_into_the_plain_optimizer_at_another_ep(tmp_path):
    """Saved at EP=2 x DP=4 with the distributed optimizer, loaded at EP=1 x DP=2 by the plain
    optimizer (its state reassembled from the shards): weights and moments bitwise."""
    folder = str(tmp_path / "ckpt")
    saved = run_distributed(4, _legacy_save_at, folder, 2)
    loaded = run_distributed(2, _legacy_load_at, folder, 1, False)
    a, wa = _whole(saved, False)
    b, wb = _whole(loaded, True)
    for name in a:
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), (name, k)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_legacy_missing_expert_folder_is_refused_in_one_line(tmp_path):
    """A legacy checkpoint saved at EP=2 whose mp_rank_00_001 folder (experts 2 and 3) is gone
    is refused at EP=1 naming the folders found, instead of loading half the experts."""
    import shutil

    folder = str(tmp_path / "ckpt")
    run_distributed(2, _legacy_save_at, folder, 2)
    shutil.rmtree(os.path.join(folder, "iter_0000003", "mp_rank_00_001"))
    kind, message = run_distributed(1, _legacy_load_at, folder, 1, True)[0]
    assert kind == "refused" and "\n" not in message
    assert "mp_rank_00_000" in message and "hold 2 experts" in message and "missing" in message


def test_legacy_plain_optimizer_at_another_ep_is_refused_in_one_line(tmp_path):
    run_distributed(2, _legacy_save_at, str(tmp_path / "ckpt"), 2, False)
    got = run_distributed(1, _legacy_load_at, str(tmp_path / "ckpt"), 1, False)[0]
    kind, message = got
    assert kind == "refused" and "\n" not in message
    assert "--expert-model-parallel-size 2" in message and "--no-load-optim" in message


def test_legacy_folder_names_read_with_the_expert_rank(tmp_path):
    """Megatron-LM's mp_rank_TT_XXX is a pipeline rank at EP = 1 and an expert rank at PP = 1 and
    EP > 1; mp_rank_TT_PPP_EEE is both."""
    from megatron.checkpointing import saved_layout

    for names, ep_run, want in ((["mp_rank_00_000", "mp_rank_00_001"], False, (1, 2)),
                                (["mp_rank_00_000", "mp_rank_00_001"], True, (1, 1)),
                                (["mp_rank_01_001_003", "mp_rank_00_000_000"], True, (2, 2)),
                                (["mp_rank_01_001_003", "mp_rank_00_000_000"], False, (2, 2))):
        folder = tmp_path / f"{len(names)}{ep_run}{names[0]}"
        for name in names:
            (folder / name).mkdir(parents=True)
        assert saved_layout(str(folder), ep_run) == want, (names, ep_run)
