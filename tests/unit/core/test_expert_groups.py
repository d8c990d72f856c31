"""The expert grid (Megatron-Core's second decomposition of the world, order tp-ep-dp-pp),
asserted rank by rank for the worked examples and against the closed form of its rank formula."""

import itertools

import pytest

from megatron.core import parallel_state as ps
from megatron.core.process_groups import ProcessGroupCollection, expert_layout_error
from tests.helpers.dist import run_distributed


def _closed_form(world, tp, pp, ep, etp):
    """Groups from rank = ((pp * EDP + edp) * EP + ep) * ETP + etp, by brute force over every
    rank's coordinates: two ranks share a group iff they agree on every fixed coordinate."""
    edp = world // (etp * ep * pp)

    def coords(r):
        return {"etp": r % etp, "ep": r // etp % ep, "edp": r // (etp * ep) % edp,
                "pp": r // (etp * ep * edp)}

    def groups(varying):
        by_key = {}
        for r in range(world):
            c = coords(r)
            key = tuple(c[d] for d in ("etp", "ep", "edp", "pp") if d not in varying)
            by_key.setdefault(key, []).append(r)
        return sorted(by_key.values())

    return {"expert_tensor": groups(("etp",)), "expert": groups(("ep",)),
            "expert_data": groups(("edp",)), "tensor_expert": groups(("etp", "ep")),
            "tensor_expert_pipeline": groups(("etp", "ep", "pp"))}


def test_16_ranks_ep2_folded_over_cp():
    # The docstring's worked example: TP=2 CP=2 PP=2 DP=2, EP=2, expert-TP = TP.
    g = ps.layout_groups(16, 2, 2, context_parallel_size=2, expert_model_parallel_size=2)
    assert g["expert_tensor"] == [[r, r + 1] for r in range(0, 16, 2)]
    assert g["expert"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["expert"] == g["context"]
    assert g["expert_data"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14],
                                [11, 15]]
    assert g["tensor_expert"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["tensor_expert_pipeline"] == [[0, 1, 2, 3, 8, 9, 10, 11],
                                           [4, 5, 6, 7, 12, 13, 14, 15]]


def test_16_ranks_ep4_expert_tp1_folded_over_tp_and_cp():
    g = ps.layout_groups(16, 2, 2, context_parallel_size=2, expert_model_parallel_size=4,
                         expert_tensor_parallel_size=1)
    assert g["expert_tensor"] == [[r] for r in range(16)]
    assert g["expert"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["expert_data"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14],
                                [11, 15]]
    assert g["tensor_expert"] == g["expert"]
    assert g["tensor_expert_pipeline"] == [[0, 1, 2, 3, 8, 9, 10, 11],
                                           [4, 5, 6, 7, 12, 13, 14, 15]]


def test_16_ranks_ep4_folded_over_cp_x_dp():
    g = ps.layout_groups(16, 2, 2, context_parallel_size=2, expert_model_parallel_size=4)
    # EP x expert-TP = 8 = TP x CP x DP: one expert replica per pipeline stage.
    assert g["expert"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["expert"] == g["data_context"]
    assert g["expert_data"] == [[r] for r in range(16)]
    assert g["tensor_expert_pipeline"] == [list(range(16))]


def test_8_ranks_ep2_folded_over_dp():
    g = ps.layout_groups(8, 2, 2, expert_model_parallel_size=2)
    assert g["expert"] == [[0, 2], [1, 3], [4, 6], [5, 7]] == g["data"]
    assert g["expert_tensor"] == g["tensor"]
    assert g["expert_data"] == [[r] for r in range(8)]
    assert g["tensor_expert"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["tensor_expert_pipeline"] == [list(range(8))]


def test_8_ranks_ep2_folded_over_tp():
    g = ps.layout_groups(8, 2, 2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    assert g["expert"] == [[0, 1], [2, 3], [4, 5], [6, 7]] == g["tensor"]
    assert g["expert_tensor"] == [[r] for r in range(8)]
    assert g["expert_data"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["tensor_expert_pipeline"] == [[0, 1, 4, 5], [2, 3, 6, 7]] == g["model"]


def test_ep1_is_the_dense_grid():
    for world, tp, pp, cp in ((8, 2, 2, 1), (16, 2, 2, 2), (8, 1, 2, 2), (4, 1, 1, 1)):
        g = ps.layout_groups(world, tp, pp, context_parallel_size=cp)
        assert g["expert_tensor"] == g["tensor"]
        assert g["expert_data"] == g["data_context"]
        assert g["tensor_expert_pipeline"] == g["model"]
        assert g["expert"] == [[r] for r in range(world)]


def test_every_layout_matches_the_rank_formula():
    for world, tp, pp, cp in itertools.product((8, 16, 24), (1, 2, 4), (1, 2), (1, 2)):
        if world % (tp * pp * cp):
            continue
        stage = world // pp
        for ep, etp in itertools.product((1, 2, 3, 4, 8), (1, 2, 4)):
            if stage % (ep * etp):
                assert expert_layout_error(world, tp, pp, cp, ep, etp)
                continue
            g = ps.layout_groups(world, tp, pp, context_parallel_size=cp,
                                 expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
            want = _closed_form(world, tp, pp, ep, etp)
            for kind, groups in want.items():
                assert sorted(g[kind]) == groups, (world, tp, pp, cp, ep, etp, kind)


def test_indivisible_expert_grid_is_one_line():
    with pytest.raises(ValueError) as err:
        ps.layout_groups(8, 2, 2, expert_model_parallel_size=3)
    msg = str(err.value)
    assert "\n" not in msg and "--expert-model-parallel-size (3)" in msg
    assert "TP x CP x DP = 4" in msg
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size \\(4\\)"):
        ps.layout_groups(8, 2, 2, expert_model_parallel_size=2, expert_tensor_parallel_size=4)


def test_world_of_one_has_expert_groups_of_one():
    one = ProcessGroupCollection.world_of_one()
    for name in ("ep", "expt_tp", "expt_dp", "tp_ep", "tp_ep_pp"):
        group = getattr(one, name)
        assert group.size == 1 and group.group is None and group.ranks == (0,)


def _expert_groups(tp, ep, etp):
    import torch
    import torch.distributed as dist
    groups = ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                          expert_tensor_parallel_size=etp)
    x = torch.tensor([float(dist.get_rank())])
    if groups.expt_dp.size > 1:
        dist.all_reduce(x, group=groups.expt_dp.group)
    return {name: (getattr(groups, name).ranks, getattr(groups, name).rank)
            for name in ("ep", "expt_tp", "expt_dp", "tp_ep", "tp_ep_pp")}, x.item()


def test_initialize_model_parallel_builds_the_expert_grid():
    # 4 ranks, TP=1 PP=1 DP=4, EP=2: expert rank = edp * 2 + ep.
    out = run_distributed(4, _expert_groups, 1, 2, 1)
    for rank, (groups, summed) in enumerate(out):
        assert groups["ep"] == (((rank // 2) * 2, (rank // 2) * 2 + 1), rank % 2)
        assert groups["expt_dp"] == ((rank % 2, rank % 2 + 2), rank // 2)
        assert groups["expt_tp"] == ((rank,), 0)
        assert groups["tp_ep_pp"] == groups["ep"]
        assert summed == (rank % 2) * 2 + 2  # r + (r + 2) over the expert-data group
