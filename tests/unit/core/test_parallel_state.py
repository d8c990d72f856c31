import pytest

from megatron.core import parallel_state as ps
from megatron.core.process_groups import ProcessGroupCollection
from tests.helpers.dist import run_distributed


def test_layout_groups_worked_example():
    g = ps.layout_groups(8, 2, 2)
    assert g["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["data"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pipeline"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["model"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Context parallelism of one: every rank its own context group, DP x CP = DP.
    assert g["context"] == [[r] for r in range(8)]
    assert g["data_context"] == g["data"]


def test_layout_groups_context_parallel_follows_megatron_core_order():
    # rank = ((pp * DP + dp) * CP + cp) * TP + tp: TP fastest, then CP, then DP, then PP.
    g = ps.layout_groups(8, 2, 1, context_parallel_size=2)
    assert g["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["context"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["data_context"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["model"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # TP x CP (a MoE layer's token group under both): the ranks of one micro-batch
    assert g["tensor_context"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ps.layout_groups(4, 2, 1)["tensor_context"] == [[0, 1], [2, 3]]
    # The 16-rank worked example of megatron.core.process_groups (TP=2 CP=2 PP=2 DP=2).
    g = ps.layout_groups(16, 2, 2, context_parallel_size=2)
    assert g["context"] == [[r, r + 2] for r in (0, 1, 4, 5, 8, 9, 12, 13)]
    assert g["data"] == [[r, r + 4] for r in (0, 1, 2, 3, 8, 9, 10, 11)]
    assert g["pipeline"] == [[r, r + 8] for r in range(8)]
    assert g["data_context"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["model"] == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]


def test_layout_groups_rejects_indivisible_world():
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        ps.layout_groups(6, 4, 1)
    with pytest.raises(ValueError, match="--context-parallel-size"):
        ps.layout_groups(8, 2, 1, context_parallel_size=3)


def test_world_of_one_and_virtual_stages():
    one = ProcessGroupCollection.world_of_one()
    assert all(getattr(one, k).size == 1 and getattr(one, k).group is None
               for k in ("tp", "pp", "dp", "cp", "dp_cp", "model", "embedding"))
    assert one.is_pipeline_first_stage() and one.is_pipeline_last_stage()
    assert not one.in_embedding_group
    chunks = ProcessGroupCollection.world_of_one(virtual_pipeline_model_parallel_size=3)
    assert [chunks.is_pipeline_first_stage(v) for v in range(3)] == [True, False, False]
    assert [chunks.is_pipeline_last_stage(v) for v in range(3)] == [False, False, True]
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_process_groups()


def _ranks(tp, pp):
    import torch
    import torch.distributed as dist
    groups = ps.initialize_model_parallel(tp, pp)
    assert groups is ps.get_process_groups()
    t = ps.get_tensor_model_parallel_group()
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=t)
    y = torch.tensor([1.0])
    dist.all_reduce(y, group=groups.dp_cp.group)
    return (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(), ps.is_pipeline_first_stage(),
            ps.is_pipeline_last_stage(), ps.get_pipeline_model_parallel_next_rank(),
            ps.get_pipeline_model_parallel_prev_rank(), x.item(),
            (groups.cp.ranks, groups.dp_cp.ranks == groups.dp.ranks, y.item(),
             groups.in_embedding_group, groups.model.ranks, groups.rank, groups.world_size))


def test_ranks_tp2_pp2_dp2():
    out = run_distributed(8, _ranks, 2, 2)
    for rank, (tp_r, dp_r, pp_r, first, last, nxt, prev, tp_sum, extra) in enumerate(out):
        assert rank == pp_r * 4 + dp_r * 2 + tp_r
        assert first == (pp_r == 0) and last == (pp_r == 1)
        assert nxt == (rank + 4) % 8 and prev == (rank - 4) % 8
        base = rank - tp_r
        assert tp_sum == base + base + 1
        cp_ranks, dp_cp_is_dp, dp_cp_size, in_embedding, model, global_rank, world = extra
        assert cp_ranks == (rank,) and dp_cp_is_dp and dp_cp_size == 2.0
        assert in_embedding and rank in model and len(model) == 4
        assert (global_rank, world) == (rank, 8)
