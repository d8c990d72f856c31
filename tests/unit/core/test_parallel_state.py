import pytest

from megatron.core import parallel_state as ps
from tests.helpers.dist import run_distributed


def test_layout_groups_worked_example():
    g = ps.layout_groups(8, 2, 2)
    assert g["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["data"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pipeline"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["model"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layout_groups_rejects_indivisible_world():
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        ps.layout_groups(6, 4, 1)


def _ranks(tp, pp):
    import torch.distributed as dist
    ps.initialize_model_parallel(tp, pp)
    t = ps.get_tensor_model_parallel_group()
    x = __import__("torch").tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=t)
    return (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(), ps.is_pipeline_first_stage(),
            ps.is_pipeline_last_stage(), ps.get_pipeline_model_parallel_next_rank(),
            ps.get_pipeline_model_parallel_prev_rank(), x.item())


def test_ranks_tp2_pp2_dp2():
    out = run_distributed(8, _ranks, 2, 2)
    for rank, (tp_r, dp_r, pp_r, first, last, nxt, prev, tp_sum) in enumerate(out):
        assert rank == pp_r * 4 + dp_r * 2 + tp_r
        assert first == (pp_r == 0) and last == (pp_r == 1)
        assert nxt == (rank + 4) % 8 and prev == (rank - 4) % 8
        base = rank - tp_r
        assert tp_sum == base + base + 1
