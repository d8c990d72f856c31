"""The planner's ZeRO-2/3 memory against the bytes a LlamaModel with the sharded strategies holds:
DP=2, bf16, 4 layers, tied and untied; ZeRO-3's parameter shards + the measured gather window,
its gradient shards and its optimizer state equal :func:`estimate_memory`'s terms exactly."""

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core import parallel_state as ps
from megatron.planner.memory import estimate_memory, zero3_unit_numels
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups

TINY = dict(num_layers=4, hidden_size=32, ffn_hidden_size=88, num_attention_heads=4,
            num_query_groups=2, padded_vocab_size=128, max_position_embeddings=32)


def _measure_both():
    return {untie: _measure(untie) for untie in (True, False)}


def _measure(untie):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.model.llama import LlamaModel
    from megatron.model.transformer import TransformerLayer

    groups = ps.initialize_model_parallel(1, 1) if not ps.model_parallel_is_initialized() \
        else ps.get_process_groups()
    config = ModelConfig(**TINY, params_dtype=torch.bfloat16,
                         untie_embeddings_and_output_weights=untie)
    model = LlamaModel(config, pg_collection=current_groups())
    ddp = DistributedDataParallel(model, data_parallel_group=groups.dp_cp.group,
                                  overlap_grad_reduce=True, use_distributed_optimizer=True,
                                  data_parallel_sharding_strategy="optim_grads_params",
                                  fsdp_unit_modules=(TransformerLayer,))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True,
                                                 use_distributed_optimizer=True), [ddp],
                                 pg_collection=current_groups())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    ddp.zero_grad_buffer()
    ddp(ids, labels=ids).float().mean().backward()
    ddp.finish_grad_sync()
    opt.step()
    mem = ddp.memory_bytes()
    units = [u.numel_padded() for u in ddp.param_units.units]
    return (mem["param_shards"], ddp.param_units.peak_gathered_bytes, mem["grad_shards"],
            opt.state_bytes(), units, mem["params"], mem["grads"])


@pytest.fixture(scope="module")
def measured():
    return run_distributed(2, _measure_both)[0]


@pytest.mark.parametrize("untie", [True, False])
def test_zero3_bytes_equal_the_planner(measured, untie):
    shards, window, grad_shards, state, units, params, grads = measured[untie]
    config = ModelConfig(**TINY, params_dtype=torch.bfloat16,
                         untie_embeddings_and_output_weights=untie)
    assert units == zero3_unit_numels(config, 1, 1, 0, 2)
    est = estimate_memory(config, tp=1, pp=1, dp=2, seq_length=16, micro_batch_size=2,
                          num_microbatches=1, bf16=True, use_distributed_optimizer=True,
                          sharding_strategy="optim_grads_params")
    psi_pad = sum(units)
    assert shards == 2 * psi_pad // 2                # bf16 shards, 2 Psi / N
    assert window == 2 * (units[0] + sum(sorted(units[1:])[-2:]))  # root + current + next
    assert est.parameters == shards + window
    assert grad_shards == 4 * psi_pad // 2           # fp32 gradient shards
    assert est.gradients == 4 * psi_pad + grad_shards  # + the full ones of the backward
    assert state == est.optimizer_distributed == 12 * psi_pad // 2
    assert params == grads == 0                      # nothing full held after the step
