"""Checkpoints of experts split over expert-TP: torch_dist boxes, and what is refused in one line.

The legacy format saves them (at expert-TP = TP each tensor rank's ``mp_rank_TT[_EEE]`` file holds
its expert-TP slice, else whole experts; loaded at any other expert-TP by merging and cutting the
slices, checked here against expert-TP 1 and k modules; end to end in
tests/e2e/test_moe_etp_ckpt_e2e.py). torch_dist
boxes each slice into the global expert tensors of an expert-TP 1 model (``weight1``'s
``[gate_t; up_t]`` as two boxes per expert): checked here element for element against an
expert-TP 1 module's weights, for whole slices and distributed-optimizer pieces."""

from types import SimpleNamespace

import pytest
import torch

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.expert_slices import cut, merge
from megatron.checkpointing.legacy_experts import file_expert_slice
from megatron.core.distributed.expert_params import mark_expert
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.model.sharded_state import param_shardings


def _groups(expert_tp_rank, expert_tp):
    one = SimpleNamespace(rank=0, size=1, ranks=(0,))
    return SimpleNamespace(ep=one, tp=one, dp_cp=one, expt_dp=one,
                           expt_tp=SimpleNamespace(rank=expert_tp_rank, size=expert_tp,
                                                   ranks=tuple(range(expert_tp))))


def _experts(expert_tp_rank, expert_tp):
    module = GroupedMLP(2, 8, 6, first_expert=0, seed=1, layer_number=1, init_method_std=0.02,
                        num_layers=1, tp_rank=expert_tp_rank, tp_size=expert_tp)
    for p in module.parameters():
        mark_expert(p)
    return module


def _assemble(shardings, modules, global_shapes):
    """The global tensors written from every rank's boxes (each element once: asserted)."""
    out = {k: torch.full(s, float("nan")) for k, s in global_shapes.items()}
    written = {k: torch.zeros(s, dtype=torch.int32) for k, s in global_shapes.items()}
    for sharding, module in zip(shardings, modules):
        for name, p in module.named_parameters():
            for box in sharding[name].boxes(p.data, ""):
                if box.replica_id:
                    continue
                where = tuple(slice(o, o + n) for o, n in zip(box.global_offset, box.data.shape))
                out[name][where] = box.data
                written[name][where] += 1
    for k in out:
        assert bool((written[k] == 1).all()), k
    return out


@pytest.mark.parametrize("expert_tp", [2, 3])
def test_torch_dist_boxes_of_expert_tp_slices_are_the_whole_experts(expert_tp):
    """The boxes of every expert-TP rank's slice rebuild, element for element, the global
    tensors an expert-TP 1 module saves (its parameters: the independent oracle)."""
    whole = _experts(0, 1)
    shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}
    modules = [_experts(r, expert_tp) for r in range(expert_tp)]
    shardings = [param_shardings(m, _groups(r, expert_tp)) for r, m in enumerate(modules)]
    got = _assemble(shardings, modules, shapes)
    for name, p in whole.named_parameters():
        assert torch.equal(got[name], p.data), name


@pytest.mark.parametrize("expert_tp", [2, 3])
def test_flat_boxes_of_expert_tp_slices_match_the_whole_experts(expert_tp):
    """Distributed-optimizer pieces (any flat range of the slice) land on the same global
    elements as the slice's own boxes: every range of a rank split in three pieces."""
    whole = _experts(0, 1)
    for rank in range(expert_tp):
        module = _experts(rank, expert_tp)
        sharding = param_shardings(module, _groups(rank, expert_tp))
        for name, p in module.named_parameters():
            target = getattr(whole, name).data
            n = p.numel()
            for lo, hi in ((0, n // 3 + 1), (n // 3 + 1, 2 * n // 3 + 5), (2 * n // 3 + 5, n)):
                flat = p.data.reshape(-1)[lo:hi]
                boxes = sharding[name].flat_boxes(lo, hi, flat, "")
                assert sum(b.data.numel() for b in boxes) == hi - lo
                for box in boxes:
                    where = tuple(slice(o, o + k)
                                  for o, k in zip(box.global_offset, box.data.shape))
                    assert torch.equal(box.data, target[where]), (name, lo, hi)


def test_expert_tp_boxes_load_in_place():
    """A load writes into the boxes' views: a zeroed slice filled from the global tensors is the
    rank's slice again."""
    whole = _experts(0, 1)
    module = _experts(1, 2)
    want = {n: p.data.clone() for n, p in module.named_parameters()}
    sharding = param_shardings(module, _groups(1, 2))
    for name, p in module.named_parameters():
        p.data.zero_()
        for box in sharding[name].boxes(p.data, ""):
            where = tuple(slice(o, o + k) for o, k in zip(box.global_offset, box.data.shape))
            box.data.copy_(getattr(whole, name).data[where])
        assert torch.equal(p.data, want[name]), name


def test_torch_dist_boxes_of_whole_experts_cover_the_global_axis():
    shardings = param_shardings(_experts(0, 1), _groups(0, 1))
    assert shardings["weight1"].regions[0].global_shape == (2, 12, 8)
    assert shardings["weight2"].regions[0].global_shape == (2, 8, 6)


def _state(**args):
    return {"args": dict(num_experts=4, tensor_model_parallel_size=2, **args)}


@pytest.mark.parametrize("expert_tp", [2, 3])
def test_legacy_expert_slices_merge_to_and_cut_from_whole_experts(expert_tp):
    """What a legacy checkpoint at another expert-TP rests on: the slices of every expert-TP
    rank merge, bitwise, into an expert-TP 1 module's weights, and cutting those gives each
    rank's slice (the modules draw whole experts and slice them: the independent oracle)."""
    whole = dict(_experts(0, 1).named_parameters())
    modules = [dict(_experts(r, expert_tp).named_parameters()) for r in range(expert_tp)]
    for name in whole:
        merged = merge(f"decoder.layers.0.mlp.experts.{name}", [m[name].data for m in modules])
        assert torch.equal(merged, whole[name].data), name
        for r, m in enumerate(modules):
            assert torch.equal(cut(name, whole[name].data, r, expert_tp), m[name].data), name


@pytest.mark.parametrize("state, tensor_rank, want", [
    ({"expert_tensor_slice": [1, 2], **_state(expert_tensor_parallel_size=2)}, 0, (1, 2)),
    ({"expert_tensor_slice": [0, 1], **_state(expert_tensor_parallel_size=4)}, 1, (0, 1)),
    (_state(expert_tensor_parallel_size=None), 1, (1, 2)),  # None: expert-TP = TP
    (_state(expert_tensor_parallel_size=2), 0, (0, 2)),
    (_state(expert_tensor_parallel_size=1), 1, (0, 1)),
])
def test_which_expert_tp_slice_a_legacy_file_holds(state, tensor_rank, want):
    assert file_expert_slice(state, tensor_rank) == want


def test_legacy_file_of_unrecorded_slices_at_expert_tp_other_than_tp_is_one_line():
    """Megatron-LM's torch format at expert-TP != TP writes one file per tensor rank, so the
    slices are not all there: refused, naming both sizes and the fix."""
    with pytest.raises(CheckpointError) as e:
        file_expert_slice(_state(expert_tensor_parallel_size=4), 0)
    message = str(e.value)
    assert "\n" not in message and "--expert-tensor-parallel-size 4 with " \
        "--tensor-model-parallel-size 2" in message and "torch_dist" in message
