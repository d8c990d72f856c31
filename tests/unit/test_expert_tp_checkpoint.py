"""Checkpoints of experts split over expert-TP: what is refused, in one line.

The legacy format saves them (each tensor rank's ``mp_rank_TT[_EEE]`` file holds its expert-TP
slice, expert-TP = TP; resumed end to end in tests/e2e/test_moe_etp_ckpt_e2e.py). torch_dist
names grouped experts on a global expert axis only, so an expert-TP slice would be recorded as
the whole expert: refused where the boxes are made. A legacy shard saved at another expert-TP
than the run's holds slices of another width: refused naming both sizes."""

from types import SimpleNamespace

import pytest

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.legacy import check_saved_expert_tp
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


@pytest.mark.parametrize("expert_tp_rank", [0, 1])
def test_torch_dist_boxes_of_expert_tp_slices_are_refused(expert_tp_rank):
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 2 have no torch_dist "
                       "checkpoint yet; use --ckpt-format torch") as e:
        param_shardings(_experts(expert_tp_rank, 2), _groups(expert_tp_rank, 2))
    assert "\n" not in str(e.value)


def test_torch_dist_boxes_of_whole_experts_cover_the_global_axis():
    shardings = param_shardings(_experts(0, 1), _groups(0, 1))
    assert shardings["weight1"].regions[0].global_shape == (2, 12, 8)
    assert shardings["weight2"].regions[0].global_shape == (2, 8, 6)


def _state(**args):
    return {"args": dict(num_experts=4, tensor_model_parallel_size=2, **args)}


@pytest.mark.parametrize("saved, run, refused", [
    (dict(expert_tensor_parallel_size=2), 2, False),
    (dict(expert_tensor_parallel_size=None), 2, False),  # None: expert-TP = TP (2)
    (dict(expert_tensor_parallel_size=1), 1, False),
    (dict(expert_tensor_parallel_size=2), 1, True),
    (dict(expert_tensor_parallel_size=None), 1, True),
    (dict(expert_tensor_parallel_size=1), 2, True),
])
def test_legacy_shard_at_another_expert_tp_is_refused_in_one_line(saved, run, refused):
    state = _state(**saved)
    if not refused:
        check_saved_expert_tp(state, "shard.pt", "ckpt", 2, run)
        return
    with pytest.raises(CheckpointError) as e:
        check_saved_expert_tp(state, "shard.pt", "ckpt", 2, run)
    message = str(e.value)
    want = saved["expert_tensor_parallel_size"] or 2
    assert "\n" not in message and "shard.pt" in message
    assert f"split at --expert-tensor-parallel-size {want}, but this run has " \
        f"--expert-tensor-parallel-size {run}" in message


def test_dense_shards_have_no_expert_tp_to_check():
    check_saved_expert_tp({"args": {"tensor_model_parallel_size": 2}}, "shard.pt", "ckpt", 2, 1)
