"""The planner's memory per rank against the bytes a LlamaModel holds at each strategy (ZeRO-1 =
the distributed optimizer, ZeRO-2, ZeRO-3) at DP=2, bf16, 4 layers, tied and untied, with and
without --overlap-grad-reduce, over an iteration of 2 micro-batches: parameters (ZeRO-1/2 the
parameter buffer; ZeRO-3 its shards + the measured gather window), gradients at their peak
(measured from the gradient storages by the DDP's meter) and the optimizer state equal
:func:`estimate_memory`'s terms exactly; ZeRO-2's and ZeRO-3's gradient peaks are below
ZeRO-1's."""

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core import parallel_state as ps
from megatron.planner.memory import estimate_memory, zero3_unit_numels
from megatron.training.startup_report import format_memory
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.zero_memory import measured_iteration

TINY = dict(num_layers=4, hidden_size=32, ffn_hidden_size=88, num_attention_heads=4,
            num_query_groups=2, padded_vocab_size=128, max_position_embeddings=32)


STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
BUCKET = 3000  # elements: several ZeRO-2 buckets in the tiny model (ZeRO-3's are its units)
NUM_MB = 2


def _measure_all():
    ps.initialize_model_parallel(1, 1)
    return {(s, untie, overlap): _measure(s, untie, overlap) for s in STRATEGIES
            for untie in (True, False) for overlap in (False, True)}


def _measure(strategy, untie, overlap):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.model.llama import LlamaModel
    from megatron.model.transformer import TransformerLayer

    groups = current_groups()
    torch.manual_seed(0)
    config = ModelConfig(**TINY, params_dtype=torch.bfloat16,
                         untie_embeddings_and_output_weights=untie)
    model = LlamaModel(config, pg_collection=groups)
    ddp = DistributedDataParallel(model, data_parallel_group=groups.dp_cp.group,
                                  bucket_size=BUCKET, overlap_grad_reduce=overlap,
                                  use_distributed_optimizer=True,
                                  data_parallel_sharding_strategy=strategy,
                                  fsdp_unit_modules=(TransformerLayer,))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True,
                                                 use_distributed_optimizer=True), [ddp],
                                 pg_collection=groups)
    measured_iteration(ddp, opt, groups, NUM_MB)  # the second of two iterations measured
    mem = ddp.memory_bytes()
    units = ([u.numel_padded() for u in ddp.param_units.units] if ddp.param_units else None)
    window = ddp.param_units.peak_gathered_bytes if ddp.param_units else 0
    params = mem["param_shards"] + window if ddp.param_units else mem["params"]
    return {"params": params, "grads": ddp.grad_meter.peak, "optimizer": opt.state_bytes(),
            "units": units, "window": window, "held": (mem["params"], mem["grads"]),
            "grad_shards": mem["grad_shards"]}


@pytest.fixture(scope="module")
def measured():
    return run_distributed(2, _measure_all)[0]


def _planned(strategy, untie, overlap):
    config = ModelConfig(**TINY, params_dtype=torch.bfloat16,
                         untie_embeddings_and_output_weights=untie)
    return config, estimate_memory(config, tp=1, pp=1, dp=2, seq_length=16, micro_batch_size=2,
                                   num_microbatches=NUM_MB, bf16=True,
                                   use_distributed_optimizer=True, bucket_size=BUCKET,
                                   sharding_strategy=strategy, overlap_grad_reduce=overlap)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("untie", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_planner_equals_the_measured_bytes(measured, strategy, untie, overlap):
    m = measured[(strategy, untie, overlap)]
    _, est = _planned(strategy, untie, overlap)
    assert (m["params"], m["grads"], m["optimizer"]) == \
        (est.parameters, est.gradients, est.optimizer_distributed)
    zero1 = measured[("optim", untie, overlap)]
    if strategy != "optim":
        assert m["grads"] < zero1["grads"]
        assert m["held"][1] == 0  # no full gradient storage between iterations


@pytest.mark.parametrize("untie", [True, False])
def test_zero3_terms(measured, untie):
    m = measured[("optim_grads_params", untie, True)]
    config, _ = _planned("optim_grads_params", untie, True)
    units = m["units"]
    assert units == zero3_unit_numels(config, 1, 1, 0, 2)
    psi_pad = sum(units)
    assert m["window"] == 2 * (units[0] + sum(sorted(units[1:])[-2:]))  # root + current + next
    assert m["grad_shards"] == 4 * psi_pad // 2           # fp32 gradient shards
    assert m["grads"] == m["grad_shards"] + 4 * (units[0] + max(units[1:]))
    assert m["held"] == (0, 0)                            # nothing full held after the step


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_startup_report_states_the_planner_bytes(strategy):
    """The start-up report's memory line names the strategy and gives the planner's bytes."""
    config, est = _planned(strategy, True, True)
    line = format_memory(config, tp=1, pp=1, dp=2, cp=1, bf16=True,
                         use_distributed_optimizer=True, sharding_strategy=strategy,
                         bucket_size=BUCKET, overlap_grad_reduce=True)
    label = {"optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}
    assert label[strategy] in line and strategy in line
    for value in (est.parameters, est.gradients, est.optimizer_distributed):
        assert f"{value} B" in line, (value, line)


@pytest.mark.parametrize("flags, label", [
    ([], "ZeRO: none"),
    (["--use-distributed-optimizer"], "ZeRO: ZeRO-1 (--use-distributed-optimizer:"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim"],
     "ZeRO: ZeRO-1 (--use-distributed-optimizer:"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
     "ZeRO: ZeRO-2 (--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads:"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
     "ZeRO: ZeRO-3 (--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params:"),
])
def test_startup_report_names_the_strategy_of_the_flags(files, capsys, flags, label):
    """From the flags through validation and the config to the printed report (the report
    said ZeRO-1 for optim_grads and optim_grads_params)."""
    from megatron.config.builder import build_config
    from megatron.core.process_groups import ProcessGroupCollection
    from megatron.training.startup_report import StartupReport
    from tests.helpers.arguments import base_argv, check

    config = build_config(check(base_argv(files) + flags, world_size=2), vocab_size=32000)
    StartupReport.print_layout(ProcessGroupCollection.world_of_one(), config)
    out = capsys.readouterr().out
    assert label in out, out
    strategy = {"none": "no_shard", "ZeRO-1": "optim", "ZeRO-2": "optim_grads",
                "ZeRO-3": "optim_grads_params"}[label.split()[1]]
    assert f"--data-parallel-sharding-strategy {strategy}; planner" in out, out
