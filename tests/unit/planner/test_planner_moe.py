"""The planner's mixture-of-experts terms against built models (gloo, 2 ranks).

Parameters, gradients and optimizer state per rank: a tiny LlamaModel whose layers are MoE
layers (router, 4 experts, a gated shared expert; one dense layer by ``--moe-layer-freq``),
bf16 with the distributed optimizer at DP=2, built at EP=1 (expert-DP 2) and at EP=2 (expert-DP
1, each layer's MoELayer built over the expert-parallel group): the DDP buffers' storages and
the optimizer parts' state equal :func:`estimate_memory`'s terms exactly. The all-to-all bytes:
a forward and backward of the alltoall dispatcher at EP=2, its floating-point exchanges counted
at ``all_to_all_single``, equal :func:`alltoall_bytes_per_iteration` (a router that sends each
token to one expert on each rank: the formula's uniform split holds exactly)."""

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core import parallel_state as ps
from megatron.planner.memory import estimate_memory, param_numels
from megatron.planner.moe import (alltoall_bytes_per_iteration, expert_data_parallel_size,
                                  moe_expert_numels, stage_expert_numels)
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.zero_memory import measured_iteration

TINY = dict(num_layers=3, hidden_size=32, ffn_hidden_size=88, num_attention_heads=4,
            num_query_groups=2, padded_vocab_size=128, max_position_embeddings=32)
MOE = MoEConfig(num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2,
                moe_layer_freq=(1, 0, 1), moe_shared_expert_intermediate_size=16,
                moe_shared_expert_gate=True)
BUCKET = 3000
NUM_MB = 2


def _measure(ep, strategy="optim"):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.expert_params import mark_expert
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.moe import MoELayer
    from megatron.model.llama import LlamaModel
    from megatron.model.transformer import TransformerLayer

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    groups = current_groups()
    torch.manual_seed(0)
    config = ModelConfig(**TINY, params_dtype=torch.bfloat16)
    model = LlamaModel(config, pg_collection=groups, moe_config=MOE)
    for layer in model.layers:
        if isinstance(layer.mlp, MoELayer):
            if ep > 1:  # the layer as an EP rank builds it: E / EP experts
                layer.mlp = MoELayer(MOE, hidden_size=config.hidden_size, seed=config.seed,
                                     layer_number=layer.layer_number, num_layers=config.num_layers,
                                     params_dtype=config.params_dtype, ep_group=groups.ep.group)
            for p in layer.mlp.experts.parameters():
                mark_expert(p)
    ddp = DistributedDataParallel(model, data_parallel_group=groups.dp_cp.group,
                                  expert_data_parallel_group=groups.expt_dp.group,
                                  bucket_size=BUCKET, use_distributed_optimizer=True,
                                  data_parallel_sharding_strategy=strategy,
                                  fsdp_unit_modules=(TransformerLayer,))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, use_distributed_optimizer=True),
                                 [ddp], pg_collection=groups)
    measured_iteration(ddp, opt, groups, NUM_MB)  # the second of two iterations measured
    mem = ddp.memory_bytes()
    if ddp.param_units is not None:  # ZeRO-3: shards + the gather window, gradients at peak
        mem = {"params": mem["param_shards"] + ddp.param_units.peak_gathered_bytes,
               "grads": ddp.grad_meter.peak}
    elif strategy == "optim_grads":  # ZeRO-2: gradient shards + the full buckets at their peak
        mem = {"params": mem["params"], "grads": ddp.grad_meter.peak}
    parts = getattr(opt, "parts", [opt])
    experts = sum(p.numel() for p in model.parameters() if getattr(p, "allreduce", True) is False)
    return {"params": mem["params"], "grads": mem["grads"],
            "optimizer": sum(part.state_bytes() for part in parts),
            "expert_numel": experts, "dense_numel": sum(p.numel() for p in model.parameters()) - experts}


def _measure_all():
    out = {ep: _measure(ep) for ep in (1, 2)}
    out.update({(ep, "zero3"): _measure(ep, "optim_grads_params") for ep in (1, 2)})
    out.update({(ep, "zero2"): _measure(ep, "optim_grads") for ep in (1, 2)})
    return out


@pytest.fixture(scope="module")
def measured():
    return run_distributed(2, _measure_all)


@pytest.mark.parametrize("ep", [1, 2])
def test_planner_equals_the_built_moe_model(measured, ep):
    config = ModelConfig(**TINY, params_dtype=torch.bfloat16)
    est = estimate_memory(config, tp=1, pp=1, dp=2, seq_length=16, micro_batch_size=2,
                          num_microbatches=NUM_MB, bf16=True, use_distributed_optimizer=True,
                          bucket_size=BUCKET, moe=MOE, ep=ep)
    for m in measured:  # every rank holds the same amount
        assert m[ep]["expert_numel"] == sum(stage_expert_numels(config, MOE, 1, 0, ep))
        assert m[ep]["dense_numel"] == sum(param_numels(config, 1, 1, 0, MOE))
        assert (m[ep]["params"], m[ep]["grads"], m[ep]["optimizer"]) == \
            (est.parameters, est.gradients, est.optimizer_distributed)
    # EP=2 halves the experts a rank holds; expert-DP 1 leaves their optimizer state unsharded
    assert measured[0][2]["expert_numel"] * 2 == measured[0][1]["expert_numel"]


@pytest.mark.parametrize("ep", [1, 2])
def test_planner_equals_the_built_moe_model_under_zero3(measured, ep):
    """ZeRO-3 (``--data-parallel-sharding-strategy optim_grads_params``): dense shards over DP,
    expert shards over expert-DP (2 at EP 1, 1 at EP 2), the gather window (root unit, the layer
    computing and the next, an MoE layer's unit its dense and expert buckets) and the peak
    gradients (shards + root + the largest layer unit) equal the built model's bytes."""
    config = ModelConfig(**TINY, params_dtype=torch.bfloat16)
    est = estimate_memory(config, tp=1, pp=1, dp=2, seq_length=16, micro_batch_size=2,
                          num_microbatches=NUM_MB, bf16=True, use_distributed_optimizer=True,
                          bucket_size=BUCKET, moe=MOE, ep=ep,
                          sharding_strategy="optim_grads_params")
    for m in measured:
        got = m[(ep, "zero3")]
        assert (got["params"], got["grads"], got["optimizer"]) == \
            (est.parameters, est.gradients, est.optimizer_distributed)
        zero1 = m[ep]
        assert got["optimizer"] == zero1["optimizer"]  # the same shards as ZeRO-1


@pytest.mark.parametrize("ep", [1, 2])
def test_planner_equals_the_built_moe_model_under_zero2(measured, ep):
    """ZeRO-2 (``--data-parallel-sharding-strategy optim_grads``): the gradient peak, the dense
    shards over DP and the expert shards over expert-DP plus the full buckets of both buffers
    live at once along the backward (:func:`interleaved_grad_window_numel`; bucket size 3000:
    several dense and expert buckets), equals the built model's meter; parameters and optimizer
    state as ZeRO-1."""
    config = ModelConfig(**TINY, params_dtype=torch.bfloat16)
    est = estimate_memory(config, tp=1, pp=1, dp=2, seq_length=16, micro_batch_size=2,
                          num_microbatches=NUM_MB, bf16=True, use_distributed_optimizer=True,
                          bucket_size=BUCKET, moe=MOE, ep=ep, sharding_strategy="optim_grads")
    for m in measured:
        got = m[(ep, "zero2")]
        assert (got["params"], got["grads"], got["optimizer"]) == \
            (est.parameters, est.gradients, est.optimizer_distributed)
        assert got["grads"] < m[ep]["grads"]  # below ZeRO-1's whole buffers
        assert (got["params"], got["optimizer"]) == (m[ep]["params"], m[ep]["optimizer"])


def test_expert_shapes_and_expert_dp():
    config = ModelConfig(**TINY)
    assert moe_expert_numels(config, MOE, 2) == [2 * 2 * 24 * 32, 2 * 32 * 24]
    assert moe_expert_numels(config, MOE, 1, 2) == [4 * 24 * 32, 4 * 32 * 12]
    assert expert_data_parallel_size(tp=2, cp=2, dp=4, ep=4, etp=2) == 2
    with pytest.raises(ValueError, match="--expert-model-parallel-size"):
        expert_data_parallel_size(tp=1, cp=1, dp=2, ep=4, etp=1)
    with pytest.raises(ValueError, match="--num-experts"):
        moe_expert_numels(config, MOE, 3)


S, B, H = 6, 2, 8


def _alltoall_rank():
    from megatron.core.transformer.moe import MoELayer
    from megatron.core.transformer.moe import token_dispatcher

    cfg = MoEConfig(num_experts=4, moe_router_topk=2)
    layer = MoELayer(cfg, hidden_size=H, ffn_hidden_size=8, seed=1, layer_number=1,
                     ep_group=dist.new_group([0, 1]))
    with torch.no_grad():  # every token to expert 0 (rank 0) and expert 2 (rank 1)
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[2, 0] = 5.0, 4.0
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(dist.get_rank()))
    x[..., 0] = 10 + x[..., 0].abs()
    sent = []
    original = token_dispatcher.dist.all_to_all_single

    def counted(out, inp, output_splits=None, input_splits=None, group=None):
        if inp.is_floating_point():  # not the token counts
            rows = [n for j, n in enumerate(input_splits) if j != dist.get_rank(group)]
            sent.append(sum(rows) * inp[0].numel() * inp.element_size())
        return original(out, inp, output_splits, input_splits, group=group)

    token_dispatcher.dist.all_to_all_single = counted
    try:
        layer(x.requires_grad_()).sum().backward()
    finally:
        token_dispatcher.dist.all_to_all_single = original
    return sent


def test_alltoall_bytes_equal_the_counted_dispatcher():
    for sent in run_distributed(2, _alltoall_rank):
        assert len(sent) == 4  # dispatch, combine, and their backwards
        assert sum(sent) == alltoall_bytes_per_iteration(S * B, 2, H, 4, ep=2)


def test_ep_in_the_search_and_the_cost_terms():
    from megatron.model.flops import num_floating_point_operations
    from megatron.planner.cost import Hardware, Layout, enumerate_layouts, estimate

    config = ModelConfig(**TINY)
    hw = Hardware(num_gpus=8, gpu_memory=80 * 2 ** 30)
    layouts = list(enumerate_layouts(config, hw, 16, 32, moe=MOE, etp=2))
    assert {l.ep for l in layouts} == {1, 2, 4}
    assert all((l.tp * l.cp * l.dp) % (l.ep * l.etp) == 0 and l.etp == 2 for l in layouts)
    assert (1, 2, 4) == tuple(sorted({l.ep for l in layouts if l.tp * l.cp * l.dp == 8}))
    two = Hardware(num_gpus=2, gpu_memory=80 * 2 ** 30)  # EP x expert-TP 2 fills the stage
    assert {l.ep for l in enumerate_layouts(config, two, 16, 32, moe=MOE, etp=2)} == {1}
    assert {l.ep for l in enumerate_layouts(config, hw, 16, 32)} == {1}  # dense: no EP

    layout = Layout(tp=1, pp=1, dp=8, micro_batch_size=1, num_microbatches=2, recompute="none",
                    sequence_parallel=False, use_distributed_optimizer=True, ep=4)
    est = estimate(config, layout, hw, 32, moe=MOE)
    tokens = 32 * 1 * 2  # s x b x m of one rank
    moe_layers = 2  # --moe-layer-freq (1, 0, 1)
    assert est.ep_comm_s == 4 * tokens * 2 * 32 * 2 * 3 / 4 * moe_layers / hw.intra_node_bandwidth
    dense = estimate(config, layout, hw, 32)
    active = num_floating_point_operations(config, 16, 32, MOE)
    assert est.compute_s / dense.compute_s == pytest.approx(
        active / num_floating_point_operations(config, 16, 32))
    assert dense.ep_comm_s == 0.0


def test_plan_cli_takes_the_moe_flags(capsys):
    """tools/plan.py with Megatron-Core's MoE flags: its launch flags (EP included) validate
    through pretrain_llama.py's parser at the planned world size; a pattern of the wrong length
    is one line and exit 2."""
    from megatron.arguments import parse_args, validate_args
    from tools.plan import main

    model = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "172",
             "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "1000",
             "--num-experts", "4", "--moe-ffn-hidden-size", "48", "--moe-router-topk", "2",
             "--moe-shared-expert-intermediate-size", "32", "--global-batch-size", "8",
             "--seq-length", "64", "--num-gpus", "4", "--gpus-per-node", "4",
             "--gpu-memory-gib", "1", "--reserved-gib", "0"]
    assert main(model + ["--moe-layer-freq", "([1]*1+[0]*1)*2"]) == 0
    out = capsys.readouterr().out
    assert "mixture of experts: 4 experts, top-2" in out and "EP all-to-all" in out
    flags = out.split("launch flags of the best layout:")[1].replace("\\", " ").split()
    flags = [f.strip("'") for f in flags]
    assert "--expert-model-parallel-size" in flags and "--moe-layer-freq" in flags
    args = validate_args(parse_args(flags + ["--mock-data", "--tokenizer-type", "NullTokenizer",
                                             "--vocab-size", "1000", "--lr", "1e-4", "--train-iters", "1"]), 4)
    assert args.num_experts == 4 and args.moe_layer_freq == (1, 0, 1, 0)
    assert main(model + ["--moe-layer-freq", "[1,0]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--moe-layer-freq" in err[0]


def test_plan_cli_reads_a_huggingface_moe_config(tmp_path, capsys):
    """Mixtral's and Qwen3-MoE's config.json fields give the MoE section."""
    import json
    from tools.plan import main

    base = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 172,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    run = ["--num-gpus", "4", "--gpu-memory-gib", "1", "--global-batch-size", "8",
           "--seq-length", "64", "--gpus-per-node", "4", "--reserved-gib", "0"]
    for extra, said in (({"num_local_experts": 4, "num_experts_per_tok": 2},
                         "4 experts, top-2, expert ffn 172"),
                        ({"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32},
                         "8 experts, top-4, expert ffn 32")):
        cfg = tmp_path / "config.json"
        cfg.write_text(json.dumps(dict(base, **extra)))
        assert main(["--hf-config", str(cfg)] + run) == 0
        assert f"mixture of experts: {said}" in capsys.readouterr().out


def test_expert_tp_follows_tp_by_default():
    """Megatron-Core's default ``--expert-tensor-parallel-size`` is TP: without ``etp`` every MoE
    layout's expert-TP is its TP (EP x TP dividing TP x CP x DP), and a TP that does not divide
    the expert width is not searched (it is with an explicit expert-TP 1)."""
    import dataclasses

    from megatron.planner.cost import Hardware, enumerate_layouts

    config = ModelConfig(**TINY)
    hw = Hardware(num_gpus=8, gpu_memory=80 * 2 ** 30)
    layouts = list(enumerate_layouts(config, hw, 16, 32, moe=MOE))
    assert {l.tp for l in layouts} == {1, 2}
    assert all(l.etp == l.tp and (l.tp * l.cp * l.dp) % (l.ep * l.tp) == 0 for l in layouts)
    odd = dataclasses.replace(MOE, moe_ffn_hidden_size=23)  # 23 % 2 != 0
    assert {l.tp for l in enumerate_layouts(config, hw, 16, 32, moe=odd)} == {1}
    assert {l.tp for l in enumerate_layouts(config, hw, 16, 32, moe=odd, etp=1)} == {1, 2}


DISPATCH_CASES = {"dropless": {"moe_grouped_gemm": True},
                  "dropless loop": {},
                  "padded": {"moe_expert_capacity_factor": 2.0,
                             "moe_pad_expert_input_to_capacity": True,
                             "moe_grouped_gemm": True}}


def _dispatch_rank(case):
    """One MoE layer at EP=2 (4 experts, top-2, fp32) under the planner's uniform routing:
    ``(saved bytes of the layer, of its router alone, the largest all_to_all_single's send +
    receive bytes, the number of row exchanges)``."""
    import dataclasses

    from benchmarks.moe import balanced_router
    from megatron.core.transformer.moe import MoELayer
    from megatron.core.transformer.moe import token_dispatcher
    from tests.helpers.activation_memory import saved_activation_bytes

    cfg = dataclasses.replace(MoEConfig(num_experts=4, moe_router_topk=2),
                              **DISPATCH_CASES[case])
    layer = MoELayer(cfg, hidden_size=H, ffn_hidden_size=12, seed=1, layer_number=1,
                     ep_group=dist.new_group([0, 1])).train()
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(dist.get_rank()))
    x.requires_grad_()
    params = list(layer.parameters())
    exchanges = []
    original = token_dispatcher.dist.all_to_all_single

    def counted(out, inp, output_splits=None, input_splits=None, group=None):
        if inp.is_floating_point():  # not the token counts
            exchanges.append(inp.untyped_storage().nbytes() + out.untyped_storage().nbytes())
        return original(out, inp, output_splits, input_splits, group=group)

    token_dispatcher.dist.all_to_all_single = counted
    try:
        with balanced_router(2, 4):
            y, saved = saved_activation_bytes(lambda: layer(x), exclude=params + [x])
            _, router = saved_activation_bytes(lambda: layer.router(x.view(-1, H)),
                                               exclude=params + [x])
            y.backward(torch.ones_like(y))
    finally:
        token_dispatcher.dist.all_to_all_single = original
    return saved, router, max(exchanges), len(exchanges)


@pytest.mark.parametrize("case", list(DISPATCH_CASES))
def test_dispatch_bytes_equal_the_built_layer(case):
    """The MoE layer keeps for backward its router's tensors, the experts' SwiGLU on the real
    rows (the activation model's ``3 e T k f``), the grouped GEMM's offsets and exactly
    :func:`dispatch_saved_bytes`; the all-to-all's largest exchange (forward or backward, the
    padding included) holds :func:`dispatch_buffer_bytes`."""
    from megatron.planner.moe import dispatch_buffer_bytes, dispatch_saved_bytes

    cfg = DISPATCH_CASES[case]
    kw = dict(token_set=S * B, capacity_factor=cfg.get("moe_expert_capacity_factor"),
              pad_to_capacity=cfg.get("moe_pad_expert_input_to_capacity", False))
    swiglu = 3 * 4 * S * B * 2 * 12
    offsets = 4 * 2 if cfg.get("moe_grouped_gemm") else 0  # [E_local] int32
    want = dispatch_saved_bytes(S * B, 2, H, 4, 4, ffn_hidden_size=12, **kw)
    buffers = dispatch_buffer_bytes(S * B, 2, H, 4, 4, ep=2, **kw)
    for saved, router, largest, calls in run_distributed(2, _dispatch_rank, case):
        assert saved - router - swiglu - offsets == want
        assert largest == buffers and calls == 4
    if kw["pad_to_capacity"]:  # capacity 2.0: twice the rows, half of them padding
        assert buffers == 2 * dispatch_buffer_bytes(S * B, 2, H, 4, 4, ep=2, token_set=S * B)


def test_estimate_adds_the_dispatch_to_the_activations():
    """``estimate_memory``'s activations of an MoE model: the dense layers of the active width
    plus, per MoE layer and micro-batch in flight, :func:`dispatch_saved_bytes`, plus one
    exchange's buffers at EP > 1 (2 MoE layers of 3 at PP = 1; 2 micro-batches, 1 in flight)."""
    from megatron.planner.memory import stage_activation_bytes
    from megatron.planner.moe import dispatch_buffer_bytes, dispatch_saved_bytes
    from megatron.model.flops import active_ffn_hidden_size

    config = ModelConfig(**TINY, params_dtype=torch.bfloat16)
    width = sum(active_ffn_hidden_size(config, MOE, i) for i in range(3)) // 3
    dense = stage_activation_bytes(config.replace(ffn_hidden_size=width), 16, 2, 1, 1, NUM_MB)
    for ep in (1, 2):
        est = estimate_memory(config, tp=1, pp=1, dp=2, seq_length=16, micro_batch_size=2,
                              num_microbatches=NUM_MB, moe=MOE, ep=ep)
        shape = (32, 2, 32, 2, 4)
        assert est.activations == dense + 2 * dispatch_saved_bytes(
            *shape, token_set=32, ffn_hidden_size=24) + dispatch_buffer_bytes(
            *shape, token_set=32, ep=ep)
