"""ZeRO-2 / ZeRO-3 with expert parameters: expert state is sharded over the expert-data-parallel
group, dense state over data parallelism. A toy network (a dense input projection, one MoE layer
of 4 experts, top-2, a dense output projection) at DP=4 with EP=2, so expert-DP = 2, over an
iteration of 3 micro-batches:

* every bucket, dense and expert, is reduce-scattered once per micro-batch (ZeRO-1: once per
  iteration);
* the gradient shards held between iterations are ``4 Psi_dense_pad / DP + 4 Psi_expert_pad /
  expert-DP`` bytes (ZeRO-1: the full buffers ``4 (Psi_dense_pad + Psi_expert_pad)``);
* peak gradient bytes per rank, measured from the storages after every gradient hook and by the
  DDP's meter, equal the formula of tests/unit/core/distributed/test_zero_grad_memory.py with
  the expert shard over expert-DP: ZeRO-2 shards + the largest bucket (a bucket's full storage
  lives from its first gradient to its reduce-scatter, and the buckets here fill one after the
  other in backward); ZeRO-3 shards + the root unit (live from the loss to the input
  projection) + the MoE unit (its dense router bucket and its expert bucket).
"""

import pytest
import torch

from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core import parallel_state as ps
from megatron.core.distributed import collectives
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups

H, F, S, B, E = 8, 8, 4, 2, 4
NUM_MB = 3
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


class MoENet(torch.nn.Module):
    def __init__(self, ep_group):
        from megatron.core.transformer.moe import MoELayer

        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(H, H)
        self.moe = MoELayer(MoEConfig(num_experts=E, moe_router_topk=2), hidden_size=H,
                            ffn_hidden_size=F, seed=3, layer_number=1, init_method_std=0.3,
                            ep_group=ep_group)
        self.out = torch.nn.Linear(H, H)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def _storage(ddp):
    mem = ddp.memory_bytes()
    return mem["grads"] + mem["grad_shards"]


def _iteration(strategy):
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.moe import MoELayer

    groups = current_groups()
    net = MoENet(groups.ep.group)
    # the default bucket size: one bucket per buffer (per unit under ZeRO-3)
    ddp = DistributedDataParallel(net, data_parallel_group=groups.dp_cp.group,
                                  expert_data_parallel_group=groups.expt_dp.group, use_distributed_optimizer=True,
                                  data_parallel_sharding_strategy=strategy,
                                  fsdp_unit_modules=(MoELayer,))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0,
                                                 use_distributed_optimizer=True), [ddp],
                                 pg_collection=groups)
    sampled = []
    for p in net.parameters():  # registered after DDP's hooks: run after them
        p.register_post_accumulate_grad_hook(lambda _p: sampled.append(_storage(ddp)))
    g = torch.Generator().manual_seed(10 + ps.get_data_parallel_rank())
    ddp.zero_grad_buffer()
    ddp.grad_meter.reset_peak()
    reduced = []
    for i in range(NUM_MB):
        x = torch.randn(S, B, H, generator=g)
        ctx = ddp.no_sync() if i < NUM_MB - 1 else torch.enable_grad()
        with ctx, collectives.recording() as events:
            ddp(x).square().mean().backward()
        reduced.append(events)
    with collectives.recording() as events:
        finalize_model_grads([ddp], pg_collection=groups)
    reduced.append(events)
    opt.step()
    buckets = [(b.numel_padded, buf.is_expert) for buf in ddp.buffers for b in buf.buckets]
    rs = [[e["numel"] for e in evs if e["op"] == "reduce_scatter"] for evs in reduced]
    units = ([[(b.numel_padded, b.params[0] in set(net.moe.experts.parameters()))
               for b in u.buckets] for u in ddp.param_units.units]
             if ddp.param_units else None)
    return {"buckets": buckets, "rs": rs, "sampled_peak": max(sampled),
            "meter_peak": ddp.grad_meter.peak, "now": _storage(ddp), "units": units,
            "expert_numel": sum(p.numel() for p in net.moe.experts.parameters()),
            "dense_numel": sum(p.numel() for n, p in net.named_parameters()
                               if not n.startswith("moe.experts"))}


def _all():
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    assert ps.get_data_parallel_world_size() == 4
    return {s: _iteration(s) for s in STRATEGIES}


@pytest.fixture(scope="module")
def measured():
    return run_distributed(4, _all)


def test_expert_state_sharded_over_expert_dp(measured):
    for rank_result in measured:
        for strategy, r in rank_result.items():
            dense = sum(n for n, expert in r["buckets"] if not expert)
            expert = sum(n for n, e in r["buckets"] if e)
            # the buckets hold the parameters (padded to a multiple of their group's size)
            assert dense >= r["dense_numel"] and dense % 4 == 0, strategy
            assert expert >= r["expert_numel"] and expert % 2 == 0, strategy
            # E/EP = 2 experts of [2F, H] and [H, F] on each rank
            assert r["expert_numel"] == 2 * (2 * F * H + H * F)
            held = 4 * (dense + expert) if strategy == "optim" else 4 * dense // 4 + \
                4 * expert // 2
            assert r["now"] == held, strategy


def test_reduce_scatter_per_micro_batch(measured):
    for strategy, got in measured[0].items():
        sizes = sorted(n for n, _ in got["buckets"])
        per_mb = got["rs"]
        if strategy == "optim":  # ZeRO-1: every bucket once, after the last gradients
            assert all(evs == [] for evs in per_mb[:NUM_MB - 1])
            assert sorted(n for evs in per_mb[NUM_MB - 1:] for n in evs) == sizes
            continue
        for evs in per_mb[:NUM_MB]:
            assert sorted(evs) == sizes, strategy
        assert per_mb[NUM_MB] == [], strategy  # nothing left for finalize_model_grads


def test_peak_gradient_bytes_equal_the_formula(measured):
    for rank_result in measured:
        for strategy, r in rank_result.items():
            sizes = [n for n, _ in r["buckets"]]
            dense = sum(n for n, e in r["buckets"] if not e)
            expert = sum(n for n, e in r["buckets"] if e)
            shards = 4 * dense // 4 + 4 * expert // 2
            if strategy == "optim":
                formula = 4 * (dense + expert)
            elif strategy == "optim_grads":
                # the dense bucket lives from the output projection's gradient to the input
                # projection's (the whole backward), the expert bucket inside that window
                assert len(sizes) == 2
                formula = shards + 4 * (dense + expert)
            else:
                root, moe = r["units"]
                assert sorted(e for _, e in moe) == [False, True]  # router; weight1 + weight2
                assert not any(e for _, e in root)
                # the root unit lives through the whole backward, the MoE unit's buckets from
                # its backward's start to their last gradients
                formula = shards + 4 * (sum(n for n, _ in root) + sum(n for n, _ in moe))
            assert r["sampled_peak"] == formula, (strategy, r["sampled_peak"], formula)
            assert r["meter_peak"] == formula, strategy
