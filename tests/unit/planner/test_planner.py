"""The planner's memory model against real models: parameter, gradient-buffer and optimizer bytes
exactly (context parallelism included: buffers and distributed-optimizer shards over DP x CP),
activation bytes within 10% of the tensors autograd saves (saved_tensors_hooks); context
parallelism in the layouts, the cost model and the CLI."""

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core import parallel_state as ps
from megatron.model import get_layer_numbers
from megatron.planner.cost import Hardware, estimate, enumerate_layouts, rank_layouts
from megatron.core.tensor_parallel.random import model_parallel_manual_seed
from megatron.planner.memory import (activation_bytes_per_layer, estimate_memory, grad_buffer_numel,
                                     layers_activation_bytes, optimizer_state_bytes, param_numels,
                                     stage_activation_bytes)
from tests.helpers.activation_memory import saved_activation_bytes
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups

TINY = dict(num_layers=2, hidden_size=32, ffn_hidden_size=88, num_attention_heads=4,
            num_query_groups=2, padded_vocab_size=128, max_position_embeddings=32)


def _measure_weights(tp, pp, bf16, untie, bucket_size, cp=1, distributed=False):
    """Build one stage wrapped in DDP, take one optimizer step; return measured and planned bytes."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.model.llama import LlamaModel

    groups = ps.initialize_model_parallel(tp, pp, context_parallel_size=cp)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = ModelConfig(**TINY, params_dtype=dtype, tensor_model_parallel_size=tp,
                         untie_embeddings_and_output_weights=untie, context_parallel_size=cp)
    rank, size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    model = LlamaModel(config, pg_collection=current_groups(), pre_process=rank == 0,
                       post_process=rank == size - 1,
                       layer_numbers=get_layer_numbers(config.num_layers, size, rank))
    ddp = DistributedDataParallel(model, data_parallel_group=groups.dp_cp.group,
                                  bucket_size=bucket_size, use_distributed_optimizer=distributed)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=bf16,
                                                 use_distributed_optimizer=distributed), [ddp],
                                 pg_collection=current_groups())
    sum(p.float().square().sum() for p in model.parameters()).backward()
    ddp.finish_grad_sync()
    opt.step()

    measured = {
        "parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
        "gradients": sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers),
        "optimizer": sum(t.numel() * t.element_size() for st in opt.optimizer.state.values()
                         for t in st.values() if torch.is_tensor(t))
        + sum(p.numel() * p.element_size() for g in getattr(opt, "fp32_from_float16_groups", [])
              for p in g),
    }
    if distributed:  # the shard's Adam moments and fp32 main params
        measured["optimizer"] = opt.state_bytes()
    numels = param_numels(config, tp, pp, rank)
    replicas = groups.dp_cp.size  # DP x CP ranks hold replicas of this shard
    planned = {"parameters": (2 if bf16 else 4) * sum(numels),
               "gradients": 4 * grad_buffer_numel(numels, replicas, bucket_size),
               "optimizer": optimizer_state_bytes(numels, mixed_precision=bf16,
                                                  distributed=distributed, dp=replicas,
                                                  bucket_size=bucket_size)}
    return measured, planned


def _measure_cases(cases):
    results = []
    for case in cases:  # one world for all cases: starting worlds is the slow part here
        results.append(_measure_weights(*case))
        ps.destroy_model_parallel()
    return results


def test_weights_gradients_optimizer_bytes_exact():
    cases = [(2, 1, False, True, None),   # TP=2, fp32
             (1, 2, True, False, None),   # PP=2, bf16 main params, tied copy on the last stage
             (1, 1, True, True, 3000),    # DP=2 with several DP-padded buckets
             # CP=2: buffers padded for, and optimizer shards over, DP x CP = 2 ranks
             (1, 1, True, True, 3000, 2, True)]
    for rank_results in run_distributed(2, _measure_cases, cases):
        for case, (measured, planned) in zip(cases, rank_results):
            assert measured == planned, case


def test_distributed_optimizer_formula():
    numels = [10, 7, 5]
    # one bucket of 22 elements padded to 24 for DP=4: 8 * 24 / 4 (fp32), 12 * 24 / 4 (bf16)
    assert grad_buffer_numel(numels, 4, None) == 24
    assert optimizer_state_bytes(numels, mixed_precision=False, distributed=True, dp=4) == 48
    assert optimizer_state_bytes(numels, mixed_precision=True, distributed=True, dp=4) == 72


# Recompute settings as ModelConfig fields, with the planner's arguments for them.
RECOMPUTE = {
    "none": ({}, dict(recompute="none")),
    "selective": (dict(recompute_granularity="selective"), dict(recompute="selective")),
    "full-uniform-1": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                       dict(recompute="full", recompute_method="uniform", recompute_num_layers=1)),
    "full-uniform-2": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
                       dict(recompute="full", recompute_method="uniform", recompute_num_layers=2)),
    "full-block-1": (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
                     dict(recompute="full", recompute_method="block", recompute_num_layers=1)),
}


def _measured_and_planned(config, setting, seq, mbs, num_layers=3):
    """Bytes ``num_layers`` layers keep for backward when run through the model's layer loop
    (``forward_layers``: full recompute checkpoints there), counted by ``saved_activation_bytes``
    without parameters and rotary tables; and the planner's bytes for the same stage."""
    from megatron.model.recompute import forward_layers
    from megatron.model.rotary import RotaryEmbedding
    from megatron.model.transformer import TransformerLayer

    fields, planner_args = RECOMPUTE[setting]
    config = config.replace(**fields)
    tp = config.tensor_model_parallel_size
    sp = config.sequence_parallel and tp > 1
    layers = torch.nn.ModuleList(TransformerLayer(config, i + 1, pg_collection=current_groups())
                                 for i in range(num_layers))
    x = torch.randn(seq // tp if sp else seq, mbs, config.hidden_size, dtype=config.params_dtype,
                    requires_grad=True)
    cos, sin = RotaryEmbedding(config.kv_channels)(torch.arange(seq).expand(mbs, seq))
    out, measured = saved_activation_bytes(
        lambda: forward_layers(layers, x, (cos, sin), None, None, config,
                               tp_group=current_groups().tp.group),
        exclude=[cos, sin, *layers.parameters()])
    out.float().sum().backward()  # recomputed storages come back; backward must run
    assert all(p.grad is not None for p in layers.parameters())
    planned = layers_activation_bytes(config, seq, mbs, tp, num_layers, sequence_parallel=sp,
                                      dtype_bytes=2 if config.params_dtype == torch.bfloat16 else 4,
                                      **planner_args)
    return measured, planned


def _within_10_percent(results):
    for key, (measured, planned) in results.items():
        assert abs(planned - measured) <= 0.1 * measured, (key, planned, measured)


@pytest.mark.parametrize("dtype,heads,groups,seq,mbs", [
    (torch.float32, 4, 2, 64, 2),    # GQA
    (torch.bfloat16, 4, 2, 64, 1),
    (torch.float32, 4, 4, 32, 2),    # MHA: values are a view of the QKV output
    (torch.bfloat16, 8, 1, 48, 2),   # MQA
])
def test_activation_bytes_within_10_percent(dtype, heads, groups, seq, mbs):
    config = ModelConfig(**{**TINY, "num_attention_heads": heads, "num_query_groups": groups},
                         params_dtype=dtype)
    _within_10_percent({setting: _measured_and_planned(config, setting, seq, mbs)
                        for setting in RECOMPUTE})


def _tp_saved_bytes(seq, mbs):
    ps.initialize_model_parallel(2, 1)
    model_parallel_manual_seed(5, ps.get_tensor_model_parallel_rank())
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for sp in (False, True):
            config = ModelConfig(**TINY, params_dtype=dtype, tensor_model_parallel_size=2,
                                 sequence_parallel=sp)
            for setting in RECOMPUTE:
                results[(str(dtype), sp, setting)] = _measured_and_planned(config, setting, seq, mbs)
    return results


def test_activation_bytes_tp2_with_and_without_sequence_parallel_within_10_percent():
    for rank_results in run_distributed(2, _tp_saved_bytes, 32, 2):
        _within_10_percent(rank_results)


def test_activation_model_orders_recompute_and_sequence_parallel():
    config = ModelConfig(**TINY)
    none, sel, full = (activation_bytes_per_layer(config, 64, 2, 2, recompute=r)
                       for r in ("none", "selective", "full"))
    assert full < sel < none
    assert activation_bytes_per_layer(config, 64, 2, 2, sequence_parallel=True) < none
    with pytest.raises(ValueError, match="recompute"):
        activation_bytes_per_layer(config, 64, 2, 2, recompute="some")
    with pytest.raises(ValueError, match="recompute_method"):
        layers_activation_bytes(config, 64, 2, 2, 4, recompute="full", recompute_method="blocks")


def test_stage_adds_the_layers_rebuilt_in_backward():
    """A 4-layer stage, 2 micro-batches in flight (PP=2): what they keep, plus the layers of one
    checkpointed group rebuilt with all their intermediates (2 for uniform 2, 1 for block)."""
    config = ModelConfig(**{**TINY, "num_layers": 8})
    x, none = 2 * 64 * 2 * 32, activation_bytes_per_layer(config, 64, 2, 1)
    stage = dict(seq_length=64, micro_batch_size=2, tp=1, pp=2, num_microbatches=4)
    assert stage_activation_bytes(config, **stage) == 2 * 4 * none
    assert stage_activation_bytes(config, **stage, recompute="full", recompute_num_layers=2) == 2 * 2 * x + 2 * none
    assert (stage_activation_bytes(config, **stage, recompute="full", recompute_method="block",
                                   recompute_num_layers=3) == 2 * (3 * x + none) + none)


def test_cost_model_terms_by_hand():
    """One layout computed by hand: bubble (p-1)/m of compute, DP ring all-reduce exposed."""
    config = ModelConfig(**TINY)
    hw = Hardware(num_gpus=4, gpu_memory=1e12, peak_flops=1e12, mfu=0.5, gpus_per_node=4,
                  intra_node_bandwidth=1e9, reserved_memory=0)
    layouts = [l for l in enumerate_layouts(config, hw, 8) if (l.tp, l.pp, l.dp, l.micro_batch_size,
               l.recompute, l.use_distributed_optimizer) == (1, 2, 2, 1, "none", False)]
    est = estimate(config, layouts[0], hw, 32)
    # Megatron formula by hand: 12 * B s L h^2 * ((1 + g/n + s/h) * 1 + f/h * 1.5 + v / (2 L h))
    layers = 12 * 8 * 32 * 2 * 32 ** 2 * ((1 + 0.5 + 1) + 88 / 32 * 1.5)
    head = 12 * 8 * 32 * 2 * 32 ** 2 * 128 / (2 * 2 * 32)  # 6 B s h v: the output layer
    # PP=2: the last stage's layers and the output layer, on its TP x DP = 2 GPUs, set the pace.
    assert est.compute_s == pytest.approx((layers / 2 + head) / (2 * 1e12 * 0.5))
    single = [l for l in enumerate_layouts(config, hw, 8) if (l.tp, l.pp, l.dp, l.micro_batch_size,
              l.recompute, l.use_distributed_optimizer) == (1, 1, 4, 1, "none", False)]
    assert estimate(config, single[0], hw, 32).compute_s == pytest.approx((layers + head) / (4 * 1e12 * 0.5))
    assert est.bubble_s == pytest.approx(est.compute_s * 1 / 4)
    psi = max(sum(param_numels(config, 1, 2, r)) for r in (0, 1))  # the busiest stage
    exposed = 2 * 0.5 * 4 * psi / 1e9 - est.compute_s / 4 * 2 / 3
    assert est.dp_comm_s == pytest.approx(max(0.0, exposed))
    assert est.iteration_s == pytest.approx(est.compute_s + est.bubble_s + est.tp_comm_s
                                            + est.pp_comm_s + est.dp_comm_s)


def test_context_parallel_memory_and_cost_terms():
    """CP = 2: activations of s / 2 tokens (exactly 1/CP: tests/unit/model/test_recompute.py),
    gradient buffer and optimizer shards over DP x CP; the cost model's K/V traffic by hand."""
    config = ModelConfig(**TINY)
    common = dict(tp=1, pp=1, micro_batch_size=2, num_microbatches=2, bf16=True,
                  use_distributed_optimizer=True, bucket_size=1000)
    split = estimate_memory(config, dp=2, seq_length=64, cp=2, **common)
    unsplit = estimate_memory(config, dp=2, seq_length=64, **common)
    assert split.activations == estimate_memory(config, dp=2, seq_length=32, **common).activations
    assert split.activations < unsplit.activations
    assert split.gradients == estimate_memory(config, dp=4, seq_length=64, **common).gradients
    assert split.optimizer_distributed == estimate_memory(config, dp=4, seq_length=64,
                                                          **common).optimizer_distributed
    hw = Hardware(num_gpus=4, gpu_memory=1e12, peak_flops=1e12, mfu=0.5, gpus_per_node=4,
                  intra_node_bandwidth=1e9, reserved_memory=0)
    layouts = {(l.tp, l.cp, l.pp, l.dp, l.micro_batch_size, l.recompute, l.sequence_parallel,
                l.use_distributed_optimizer): l for l in enumerate_layouts(config, hw, 8, 64)}
    assert {k[1] for k in layouts} == {1, 2, 4}
    est = estimate(config, layouts[(1, 4, 1, 1, 2, "none", False, True)], hw, 64)
    # 3 other ranks' K/V blocks (2 x b x s/CP x g x d, bf16) forward and backward, fp32 dK/dV:
    kv_block = 2 * 2 * 16 * 2 * 8
    assert est.cp_comm_s == pytest.approx(2 * 4 * 3 * kv_block * (2 * 2 + 4) / 1e9)
    assert est.iteration_s == pytest.approx(est.compute_s + est.bubble_s + est.tp_comm_s
                                            + est.pp_comm_s + est.dp_comm_s + est.cp_comm_s)
    # Sequences the split cannot cut (s % 2 CP) and sequence parallelism needing s % 2 CP TP.
    assert {l.cp for l in enumerate_layouts(config, hw, 8, 12)} == {1, 2}
    assert not [l for l in enumerate_layouts(config, hw, 8, 12) if l.cp == 2 and l.sequence_parallel]


def test_long_sequences_need_context_parallelism():
    config = ModelConfig(**TINY)
    seq = 2 ** 16
    roomy = Hardware(num_gpus=4, gpu_memory=1e15, gpus_per_node=4, reserved_memory=0)
    least = min(r.memory.total for r in rank_layouts(config, roomy, 4, seq,
                                                     allow_context_parallel=False))
    hw = Hardware(num_gpus=4, gpu_memory=least * 0.9, gpus_per_node=4, reserved_memory=0)
    ranked = rank_layouts(config, hw, 4, seq)
    assert ranked and all(r.layout.cp > 1 for r in ranked)
    assert rank_layouts(config, hw, 4, seq, allow_context_parallel=False) == []


def test_rank_layouts_filters_by_memory_and_errors_clearly():
    config = ModelConfig(**TINY)
    hw = Hardware(num_gpus=4, gpu_memory=1e12, gpus_per_node=4, reserved_memory=0)
    ranked = rank_layouts(config, hw, 8, 32, vocab_size=100)
    assert ranked and all(r.fits for r in ranked)
    times = [r.iteration_s for r in ranked]
    assert times == sorted(times)
    tight = Hardware(num_gpus=4, gpu_memory=ranked[0].memory.total * 0.5, gpus_per_node=4, reserved_memory=0)
    assert all(r.memory.total <= tight.gpu_memory for r in rank_layouts(config, tight, 8, 32))
    with pytest.raises(ValueError, match="--global-batch-size"):
        rank_layouts(config, Hardware(num_gpus=3, gpu_memory=1e12, gpus_per_node=1), 7, 32)


def test_plan_cli_prints_best_flags(tmp_path, capsys):
    import json
    from tools.plan import main
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 172,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}))
    assert main(["--hf-config", str(cfg), "--num-gpus", "4", "--gpu-memory-gib", "1",
                 "--global-batch-size", "8", "--seq-length", "64", "--gpus-per-node", "4",
                 "--reserved-gib", "0"]) == 0
    out = capsys.readouterr().out
    assert "launch flags of the best layout" in out and "--tensor-model-parallel-size" in out
    assert "--untie-embeddings-and-output-weights" in out and "--num-query-groups 2" in out
    assert ("assumptions: peak 989 TFLOP/s per GPU (--peak-tflops), model FLOP utilisation of "
            "compute 0.45 (--mfu), links 200 GB/s per GPU within a node of 4 GPUs") in out
    assert "25 GB/s across nodes" in out and "ZeRO-2/3" in out
    # A long sequence on small GPUs: only a context-parallel layout fits.
    assert main(["--hf-config", str(cfg), "--num-gpus", "4", "--gpu-memory-gib", "0.35",
                 "--global-batch-size", "4", "--seq-length", "65536", "--gpus-per-node", "4",
                 "--reserved-gib", "0", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "--context-parallel-size" in out and "--attention-dropout 0.0" in out
    assert "TP  CP  PP  DP" in out and "+ CP " in out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["--hf-config", str(bad), "--num-gpus", "4", "--gpu-memory-gib", "1",
                 "--global-batch-size", "8", "--seq-length", "64"]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err


def test_rank_layouts_drops_rows_another_makes_redundant():
    """LLaMA-2 7B on 8 GPUs: the distributed optimizer and sequence parallelism often change
    memory but no modelled time; of such rows only the one with the least memory stays."""
    from megatron.planner import cost

    config = ModelConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                         num_attention_heads=32, num_query_groups=32, kv_channels=128,
                         padded_vocab_size=32000, max_position_embeddings=4096)
    hw = Hardware(num_gpus=8, gpu_memory=80 * 2 ** 30, gpus_per_node=8)
    ranked = rank_layouts(config, hw, 256, 4096, vocab_size=32000)
    keys = [(r.layout.tp, r.layout.cp, r.layout.pp, r.layout.dp, r.layout.micro_batch_size,
             r.layout.recompute, round(r.iteration_s, 9)) for r in ranked]
    assert len(keys) == len(set(keys))
    every = sorted((r for r in (cost.estimate(cost.config_for_tp(config, l.tp, 32000), l, hw, 4096)
                                for l in cost.enumerate_layouts(config, hw, 256, 4096)) if r.fits),
                   key=lambda r: (r.iteration_s, r.memory.total))
    assert len(every) > len(ranked)  # there were redundant rows
    for r in every:  # each dropped row has a kept one as fast with no more memory
        L = r.layout
        twin = next(k for k, key in zip(ranked, keys) if key == (
            L.tp, L.cp, L.pp, L.dp, L.micro_batch_size, L.recompute, round(r.iteration_s, 9)))
        assert twin.memory.total <= r.memory.total
