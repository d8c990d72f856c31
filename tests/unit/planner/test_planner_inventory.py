"""The planner's inventory comes from the model, not from a copy of its layout: a model flag the
planner has no code for (``--qk-layernorm``, ``--add-qkv-bias``, ``--add-bias-linear``) changes
the planner's bytes, and they equal the bytes of the model built for real (single process, CPU;
the oracle is ``LlamaModel.parameters()`` itself). The meta builds draw and allocate nothing."""

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.model.llama import LlamaModel
from megatron.planner.inventory import build_meta_stage, stage_inventory
from megatron.planner.memory import estimate_memory, param_numels, zero3_unit_numels

TINY = dict(num_layers=2, hidden_size=32, ffn_hidden_size=88, num_attention_heads=4,
            num_query_groups=2, padded_vocab_size=128, max_position_embeddings=32,
            params_dtype=torch.bfloat16)
FLAGS = [{}, {"qk_layernorm": True}, {"add_qkv_bias": True}, {"add_bias_linear": True},
         {"qk_layernorm": True, "add_bias_linear": True, "untie_embeddings_and_output_weights": True}]


def _built(config, moe=None):
    torch.manual_seed(0)
    return LlamaModel(config, pg_collection=ProcessGroupCollection.world_of_one(), moe_config=moe)


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "+".join(f) or "plain")
def test_planner_bytes_follow_a_model_flag(flags):
    config = ModelConfig(**TINY, **flags)
    model = _built(config)
    built_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    est = estimate_memory(config, tp=1, pp=1, dp=1, seq_length=16, micro_batch_size=1,
                          num_microbatches=1, bf16=True)
    assert est.parameters == built_bytes
    assert param_numels(config, 1) == [p.numel() for p in model.parameters()]
    assert stage_inventory(config, 1).names == tuple(n for n, _ in model.named_parameters())
    if flags:  # the flag reached the planner without a planner edit
        plain = estimate_memory(ModelConfig(**TINY), tp=1, pp=1, dp=1, seq_length=16,
                                micro_batch_size=1, num_microbatches=1, bf16=True)
        assert est.parameters > plain.parameters


def test_zero3_units_are_the_built_layers():
    """The root unit and one unit per layer, padded to DP=2: each equals the built modules'
    elements (the layers' own, the rest for the root)."""
    config = ModelConfig(**TINY, qk_layernorm=True)
    model = _built(config)
    pad = lambda n: -(-n // 2) * 2  # noqa: E731
    layers = [pad(sum(p.numel() for p in layer.parameters())) for layer in model.layers]
    root = pad(sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for layer in model.layers for p in layer.parameters()))
    assert zero3_unit_numels(config, 1, 1, 0, 2) == [root] + layers


@pytest.mark.parametrize("untie", [True, False])
def test_meta_stage_is_the_rank_shard(untie):
    """TP=2, PP=2 planned in one process: the last stage (layer 2, the final norm, the output
    layer or the tied copy of the embedding) holds the full model's tensors with each tensor-parallel one halved along
    its ``partition_dim``."""
    config = ModelConfig(**TINY, untie_embeddings_and_output_weights=untie)
    meta = dict(build_meta_stage(config, tp=2, pp=2, pp_rank=1).named_parameters())
    full = dict(_built(config).named_parameters())
    assert all(p.is_meta for p in meta.values())
    expected = {}
    for name, p in full.items():
        if name.startswith("layers.0.") or (untie and name.startswith("word_embeddings.")):
            continue
        shape = list(p.shape)
        if vars(p).get("tensor_model_parallel", False):
            shape[p.partition_dim] //= 2
        name = name.replace("layers.1.", "layers.0.").replace("word_embeddings.",
                                                                 "word_embeddings_for_head.")
        expected[name] = tuple(shape)
    assert {n: tuple(p.shape) for n, p in meta.items()} == expected


def test_expert_marks_come_from_the_model():
    moe = MoEConfig(num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2,
                    moe_shared_expert_intermediate_size=16)
    config = ModelConfig(**TINY)
    model = _built(config, moe)
    from megatron.core.distributed.expert_params import is_expert_param
    inv = stage_inventory(config, 1, moe=moe, ep=2)
    experts = [p.numel() // 2 for p in model.parameters() if is_expert_param(p)]
    assert list(inv.expert) == experts
    assert list(inv.dense) == [p.numel() for p in model.parameters() if not is_expert_param(p)]


def test_a_config_with_rope_scaling_is_inventoried():
    """A Llama-3.1 config carries ``rope_scaling`` as a dict: the cached inventory takes it (a
    run with --rope-scaling crashed in the save folder's byte estimate before)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = ModelConfig(**TINY, rope_scaling=scaling)
    assert param_numels(config, 1) == [p.numel() for p in _built(config).parameters()]
    assert stage_inventory(config, 1) is stage_inventory(ModelConfig(**TINY, rope_scaling=dict(scaling)), 1)
