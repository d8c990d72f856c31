"""The logged losses' reduction (megatron/training/train.py): each micro-batch's loss function
returns this rank's ``(sum, count)``; ``reduce_loss_dicts`` adds them over the micro-batches and
then over the data x context-parallel group once per step (once per evaluation in ``evaluate``).

Checked against the mean written out: every evaluation iteration and micro-batch counts, weighted
by its tokens; and the non-finite-loss skip is taken from the reduced sums, so a loss that only one
data-parallel rank sees as NaN skips the step on every rank (the plain optimizer's found-inf
reduction spans only the model-parallel group)."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from megatron.core.pipeline_parallel.common import PipelineConfig
from megatron.core.process_groups import ProcessGroupCollection
from megatron.training.train import (evaluate, loss_means, nonfinite_loss_flag,
                                     reduce_loss_dicts, train_step)
from tests.helpers.dist import run_distributed

S, B, H = 3, 2, 4


def _batches(n):
    """``n`` micro-batches ``(x [s, b, h], mask [s, b])`` with unequal token counts."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        mask = (torch.rand(S, B, generator=g) < 0.25 + 0.12 * i).float()
        mask[0, 0] = 1.0
        out.append((torch.randn(S, B, H, generator=g), mask))
    return out


def _loss_func(mask, report_nan, output):
    per_token = output.square().sum(-1)  # [s, b]
    loss = (per_token * mask).sum()
    reported = torch.full((), float("nan")) if report_nan else loss.detach()
    return loss / mask.sum(), {"lm loss": (reported, mask.sum()), "steps": 1.0}


def _forward_step(data_iterator, model, report_nan=False):
    x, mask = next(data_iterator)
    return model(x), partial(_loss_func, mask, report_nan)


def _config(eval_iters, num_microbatches):
    return SimpleNamespace(
        training=SimpleNamespace(eval_iters=eval_iters, num_microbatches=num_microbatches,
                                 micro_batch_size=B),
        data=SimpleNamespace(seq_length=S), moe=None)


def test_reduce_loss_dicts_sums_micro_batches_in_float64_in_the_first_dicts_key_order():
    dicts = [{"b": (torch.tensor(1.5), torch.tensor(2.0)), "a": 3.0},
             {"a": torch.tensor(4.0), "b": (torch.tensor(2.25), 1)}]
    reduced = reduce_loss_dicts(dicts)
    assert list(reduced) == ["b", "a"]
    assert all(t.dtype == torch.float64 for pair in reduced.values() for t in pair)
    assert [float(t) for t in reduced["b"]] == [3.75, 3.0]
    assert [float(t) for t in reduced["a"]] == [7.0, 2.0]  # a bare value counts once
    assert loss_means(reduced) == {"b": 1.25, "a": 3.5}
    assert reduce_loss_dicts([]) == {} and nonfinite_loss_flag({}) is False
    assert not bool(nonfinite_loss_flag(reduced))
    dicts[1]["a"] = torch.tensor(float("inf"))
    assert bool(nonfinite_loss_flag(reduce_loss_dicts(dicts)))


def test_evaluate_weights_every_iteration_and_micro_batch_by_its_tokens():
    iters, m = 3, 2
    torch.manual_seed(0)
    model = torch.nn.Linear(H, H)
    batches = _batches(iters * m)
    got = evaluate(_forward_step, iter(batches), [model], config=_config(iters, m),
                   schedule_config=PipelineConfig(hidden_size=H),
                   pg_collection=ProcessGroupCollection.world_of_one())
    with torch.no_grad():
        sums = [float((model(x).square().sum(-1) * mask).sum()) for x, mask in batches]
    tokens = [float(mask.sum()) for _, mask in batches]
    assert len(set(tokens)) > 2  # the weighting matters
    assert got["lm loss"] == pytest.approx(sum(sums) / sum(tokens), rel=1e-6)
    assert got["steps"] == 1.0
    assert model.training


class _Scheduler:
    def __init__(self):
        self.samples = 0

    def step(self, increment):
        self.samples += increment


def _nan_on_one_rank(report_nan_rank):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.helpers.groups import current_groups

    ps.initialize_model_parallel(1, 1)
    pg = current_groups()
    rank = ps.get_data_parallel_rank()
    torch.manual_seed(0)
    net = torch.nn.Linear(H, H)
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group(),
                                  bucket_size=40)
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1), [ddp], pg_collection=pg)
    before = [p.detach().clone() for p in net.parameters()]
    scheduler = _Scheduler()
    m = 2
    data = iter(_batches(2 * m)[rank * m:(rank + 1) * m])
    step = partial(_forward_step, report_nan=rank == report_nan_rank)
    losses, skipped, _, _ = train_step(
        step, data, [ddp], opt, scheduler, config=_config(0, m),
        schedule_config=PipelineConfig(hidden_size=H), num_microbatches=m,
        global_batch_size=2 * m * B, pg_collection=pg)
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, net.parameters()))
    return skipped, changed, scheduler.samples, losses["lm loss"], losses["steps"]


def test_a_loss_only_one_data_parallel_rank_reports_as_nan_skips_the_step_on_both():
    # The gradients stay finite (only the reported sum is NaN): the skip comes from the
    # reduced loss sums alone, and both ranks must take it.
    results = run_distributed(2, _nan_on_one_rank, 1)
    for skipped, changed, samples, lm, steps in results:
        assert (skipped, changed, samples) == (1, False, 0)
        assert lm != lm and steps == 1.0  # the NaN is seen on both ranks
    finite = run_distributed(2, _nan_on_one_rank, None)
    assert [r[:3] for r in finite] == [(0, True, 4 * B)] * 2
    assert finite[0][3] == finite[1][3]
