"""Expert parameters through their own buffers and optimizer part, against one process.

At EP=2 over 4 ranks (TP=1 PP=1 DP=4; expert-data groups [0, 2] [1, 3]) every EP rank owns a
distinct expert (a parameter set the loss of its samples uses; no routing is built yet): its
gradient is reduced over expert-DP only, its optimizer part is sharded over expert-DP, and its
squared norm is summed over the EP group. The oracle is one process holding the dense weights
and both experts, each sample sent to the expert of the rank that read it, plain torch AdamW and
torch's clip_grad_norm_ over every parameter.
"""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.distributed.expert_params import is_expert_param, mark_expert
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from tests.helpers.dist import run_distributed

LR, WD, CLIP, STEPS, WORLD, EP = 1e-2, 0.1, 0.05, 4, 4, 2
GLOBAL = 16  # samples per iteration, WORLD micro-batches of 4


class ExpertNet(torch.nn.Module):
    """Dense input and output layers around one expert (a residual MLP block) per EP rank."""

    def __init__(self, experts):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 4)
        self.experts = torch.nn.ModuleList()
        for e in experts:  # each expert drawn from its own seed: the same whoever holds it
            g = torch.Generator().manual_seed(100 + e)
            layer = torch.nn.Linear(16, 16)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(16, 16, generator=g) * 0.3)
                layer.bias.copy_(torch.randn(16, generator=g) * 0.1)
            for p in layer.parameters():
                mark_expert(p)
            self.experts.append(layer)

    def forward(self, x, expert=0):
        h = torch.tanh(self.inp(x))
        return self.out(h + torch.tanh(self.experts[expert](h)))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL, 8, generator=g), torch.randn(GLOBAL, 4, generator=g)


def _reference(steps):
    """One process: every expert, rank r's samples through expert r % EP; the loss the mean of
    the ranks' mean losses (what DP x CP averaging computes)."""
    net = ExpertNet(range(EP))
    decay = [p for n, p in net.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in net.named_parameters() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    norms, grads = [], []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(net(xr, r % EP), yr)
                   for r, (xr, yr) in enumerate(zip(x.chunk(WORLD), y.chunk(WORLD)))) / WORLD
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}, norms, grads


def _train(distributed, steps, poison_step=None):
    from tests.helpers.groups import current_groups

    groups = ps.initialize_model_parallel(1, 1, expert_model_parallel_size=EP)
    rank = torch.distributed.get_rank()
    ep_rank = groups.ep.rank
    net = ExpertNet([ep_rank])
    assert all(is_expert_param(p) == n.startswith("experts.") for n, p in net.named_parameters())
    ddp = DistributedDataParallel(net, data_parallel_group=groups.dp_cp.group,
                                  expert_data_parallel_group=groups.expt_dp.group,
                                  use_distributed_optimizer=distributed)
    buffers = sorted((buf.is_expert, torch.distributed.get_process_group_ranks(
        buf.data_parallel_group)) for buf in ddp.buffers)
    config = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                             use_distributed_optimizer=distributed)
    opt = get_megatron_optimizer(config, [ddp], pg_collection=current_groups())
    assert isinstance(opt, ChainedOptimizer) and [p.expert for p in opt.parts] == [False, True]
    norms, grads, oks = [], {}, []
    for step in range(steps):
        x, y = _batch(step)
        xr, yr = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(xr), yr)
        if step == poison_step and rank == WORLD - 1:
            loss = loss * float("inf")
        loss.backward()
        finalize_model_grads([ddp], pg_collection=groups)
        if step == 0:
            grads = {n: p.main_grad.clone() for n, p in net.named_parameters()}
        ok, norm, _ = opt.step()
        oks.append(ok)
        norms.append(norm)
    ddp.finish_param_sync()
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return ep_rank, buffers, params, norms, grads, oks


def _global_names(local, ep_rank):
    return local.replace("experts.0.", f"experts.{ep_rank}.")


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_expert_parts_at_ep2_equal_one_process(distributed):
    want, want_norms, want_grads = _reference(STEPS)
    out = run_distributed(WORLD, _train, distributed, STEPS)
    for rank, (ep_rank, buffers, params, norms, grads, oks) in enumerate(out):
        assert ep_rank == rank % EP
        # dense buffer over DP x CP = all 4 ranks; expert buffer over expert-DP [r % 2, r % 2 + 2]
        assert buffers == [(False, [0, 1, 2, 3]), (True, [rank % EP, rank % EP + EP])]
        assert all(oks)
        # The first iteration's reduced gradients (whole under the plain optimizer; the
        # distributed one reduce-scatters: only the rank's shard is reduced).
        for name, g in grads.items() if not distributed else ():
            torch.testing.assert_close(g, want_grads[_global_names(name, ep_rank)], rtol=1e-6,
                                       atol=1e-7)
        # the norm of every parameter, both experts counted once
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-6,
                                   atol=0)
        assert min(want_norms) > CLIP  # every step clips
        for name, p in params.items():
            torch.testing.assert_close(p, want[_global_names(name, ep_rank)], rtol=1e-5,
                                       atol=1e-6)


def test_nonfinite_expert_loss_skips_every_part_on_every_rank():
    # Rank 3's loss is inf at step 1: its expert's (EP rank 1) and the dense gradients turn
    # non-finite; every rank of both expert-DP groups skips, then training goes on.
    out = run_distributed(WORLD, _train, True, 3, 1)
    for ep_rank, _, params, norms, _, oks in out:
        assert oks == [True, False, True]
    # Both EP ranks' replicas agree after the skip (the same step count on every part).
    for a, b in ((0, 2), (1, 3)):
        for name in out[a][2]:
            assert torch.equal(out[a][2][name], out[b][2][name])
