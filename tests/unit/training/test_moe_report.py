"""The start-up report's parameter lines of a mixture-of-experts model at EP = 2, against the
parameters of the same layer built whole in one process."""

from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.training.startup_report import count_parameters, format_parameter_counts
from tests.helpers.dist import run_distributed

MOE = MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=6,
                moe_shared_expert_intermediate_size=4)
H = 8


def _row(ep):
    groups = ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    layer = MoELayer(MOE, hidden_size=H, seed=1, layer_number=1, ep_group=groups.ep.group)
    return (groups.tp.rank, groups.pp.rank, *count_parameters([layer]), groups.ep.rank)


def test_ep2_report_counts_every_expert_once_and_the_active_share():
    whole = MoELayer(MOE, hidden_size=H, seed=1, layer_number=1)
    total = sum(p.numel() for p in whole.parameters())
    experts = sum(p.numel() for p in whole.experts.parameters())
    active = total - experts + experts * 2 // 4  # top-2 of 4
    rows = [(t, p, n, c, e, x) for t, p, n, c, x, e in run_distributed(2, _row, 2)]
    assert [r[5] for r in rows] == [experts // 2] * 2
    lines = format_parameter_counts(rows, MOE)
    assert lines[-2].startswith(f" > total number of parameters: {total} (")
    assert f"experts {experts})" in lines[-2]
    assert lines[-1].startswith(f" > active parameters per token: {active} (")
    assert lines[0].endswith(f"(0, 0, 0): {total - experts // 2} (experts {experts // 2}; "
                             f"active {active})")
    # expert-TP 2 x EP 2 at TP 1 (over DP 4): each (EP, expert-TP) rank holds a quarter of the
    # experts (deduplicating by (TP, PP, EP) counted half of them)
    split = [(0, 0, total - experts + experts // 4, 0, e, experts // 4, r)
             for e in (0, 1) for r in (0, 1)]
    lines = format_parameter_counts(split, MOE)
    assert lines[-2].startswith(f" > total number of parameters: {total} (")
    assert f"experts {experts})" in lines[-2]
    assert lines[-1].startswith(f" > active parameters per token: {active} (")
    assert "(tensor, pipeline, expert, expert-tensor) model parallel rank (0, 0, 1, 1)" in lines[3]
    # a dense model's lines are Megatron-LM's, as before
    dense = format_parameter_counts([(0, 0, 10, 0), (0, 0, 10, 0)], None)
    assert dense[0] == " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 10"
    assert dense[1].startswith(" > total number of parameters: 10 (")
