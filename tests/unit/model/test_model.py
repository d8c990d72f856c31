"""LLaMA model at TP=1: equals transformers' LlamaForCausalLM (weights copied across), pipeline
stages compose to the whole model, initialisation is seeded by layer and name, bad configs fail.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.model import get_layer_numbers
from megatron.model.attention_mask import AttentionMask
from megatron.core.transformer.initialization import from_fused_layout, to_fused_layout
from megatron.model.llama import LlamaModel
from tests.helpers.groups import current_groups
from tests.helpers.model import LLAMA3_SCALING, batch, copy_hf_into_ours, hf_model, small_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("changes", [
    {},
    {"untie_embeddings_and_output_weights": False},
    {"rope_scaling": LLAMA3_SCALING, "max_position_embeddings": 128},
    {"num_query_groups": 8, "kv_channels": 16},  # plain MHA, head width != hidden / heads
], ids=["gqa", "tied", "llama3-rope-scaling", "mha-kv-channels"])
def test_logits_and_loss_equal_transformers(changes):
    config = small_config(**changes)
    hf = hf_model(config)
    ours = LlamaModel(config, pg_collection=current_groups()).eval()
    copy_hf_into_ours(ours, hf)
    tokens, labels = batch(config, s=48)
    with torch.no_grad():
        expected = hf(tokens).logits
        logits = ours(tokens)
        loss = ours(tokens, labels=labels)
    assert logits.shape == expected.shape and logits.dtype == torch.float32
    assert expected.abs().max() > 1.0  # far from uniform: the comparison has teeth
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    ref_loss = F.cross_entropy(expected.flatten(0, 1), labels.flatten(), reduction="none")
    assert loss.shape == labels.shape and loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss.view_as(labels), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mistake", ["gate-up-swapped", "k-v-swapped", "group-order"])
def test_a_wrong_fused_layout_is_caught(mistake):
    """The HF comparison can fail: each classic conversion mistake changes the logits."""
    config = small_config()
    hf = hf_model(config)
    ours = LlamaModel(config, pg_collection=current_groups()).eval()
    copy_hf_into_ours(ours, hf)
    layer = ours.layers[0]
    d, nh, ng, f = config.kv_channels, config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size
    with torch.no_grad():
        if mistake == "gate-up-swapped":
            gate, up = from_fused_layout(layer.mlp.dense_h_to_4h.weight, [f, f], 1)
            layer.mlp.dense_h_to_4h.weight.copy_(to_fused_layout([up, gate], 1))
        else:
            q, k, v = from_fused_layout(layer.self_attention.query_key_value.weight,
                                        [nh * d, ng * d, ng * d], 1)
            if mistake == "k-v-swapped":
                k, v = v, k
            else:
                k = torch.cat(k.split(d)[::-1])
                v = torch.cat(v.split(d)[::-1])
            layer.self_attention.query_key_value.weight.copy_(to_fused_layout([q, k, v], 1))
    tokens, _ = batch(config)
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() > 1e-2


def test_document_masks_and_reset_positions_equal_separate_documents():
    """--reset-attention-mask / --reset-position-ids: two packed documents give the logits of
    each document run alone."""
    config = small_config()
    ours = LlamaModel(config, pg_collection=current_groups()).eval()
    tokens, _ = batch(config, b=1, s=40)
    cut = 17
    s = tokens.shape[1]
    doc = torch.zeros(s, dtype=torch.long)
    doc[cut:] = 1
    mask = AttentionMask.from_document_ids(doc[None])
    positions = torch.cat([torch.arange(cut), torch.arange(s - cut)])[None]
    with torch.no_grad():
        packed = ours(tokens, positions, mask)
        first = ours(tokens[:, :cut])
        second = ours(tokens[:, cut:])
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_compose_to_the_whole_model(tied):
    config = small_config(num_layers=4, untie_embeddings_and_output_weights=not tied)
    whole = LlamaModel(config, pg_collection=current_groups())
    stages = [LlamaModel(config,
                         pg_collection=current_groups(), pre_process=r == 0, post_process=r == 1,
                         layer_numbers=get_layer_numbers(4, 2, r)) for r in range(2)]
    assert [l.layer_number for l in stages[1].layers] == [3, 4]
    tokens, labels = batch(config)

    loss = whole(tokens, labels=labels)
    loss.sum().backward()
    hidden = stages[0](tokens)
    assert hidden.shape == (tokens.shape[1], tokens.shape[0], config.hidden_size)
    stages[1].set_input_tensor([hidden])
    staged_loss = stages[1](None, labels=labels)
    staged_loss.sum().backward()
    torch.testing.assert_close(staged_loss, loss, atol=1e-6, rtol=1e-6)

    grads = {}
    for r, stage in enumerate(stages):
        offset = 2 * r
        for name, p in stage.named_parameters():
            if name.startswith("layers."):
                i, rest = name[len("layers."):].split(".", 1)
                name = f"layers.{int(i) + offset}.{rest}"
            if name == "word_embeddings_for_head.weight":
                # The tied copy starts equal to the first stage's embedding; the embedding group
                # all-reduce sums the two gradients.
                torch.testing.assert_close(p, stages[0].word_embeddings.weight, atol=0, rtol=0)
                assert p.shared_embedding and stages[0].word_embeddings.weight.shared_embedding
                name = "word_embeddings.weight"
            grads[name] = grads.get(name, 0) + p.grad
    expected = {n: p.grad for n, p in whole.named_parameters()}
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)
    assert stages[0].shared_embedding_or_output_weight() is stages[0].word_embeddings.weight


def test_init_is_seeded_by_layer_and_name_and_leaves_the_rng_alone():
    config = small_config(num_layers=4, init_method_std=0.05)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    whole = LlamaModel(config, pg_collection=current_groups())
    assert torch.equal(torch.random.get_rng_state(), before)
    last = LlamaModel(config, pg_collection=current_groups(), pre_process=False, layer_numbers=[4])
    torch.testing.assert_close(last.layers[0].state_dict(), whole.layers[3].state_dict(), atol=0, rtol=0)
    w = dict(whole.named_parameters())
    assert not torch.equal(w["layers.0.mlp.dense_4h_to_h.weight"], w["layers.1.mlp.dense_4h_to_h.weight"])
    # Scaled init for output projections: std / sqrt(2 * num_layers).
    scaled = 0.05 / math.sqrt(8)
    for name in ["layers.0.self_attention.dense.weight", "layers.2.mlp.dense_4h_to_h.weight"]:
        assert abs(w[name].std().item() - scaled) < 0.15 * scaled, name
    for name in ["layers.0.self_attention.query_key_value.weight", "output_layer.weight",
                 "word_embeddings.weight", "layers.3.mlp.dense_h_to_4h.weight"]:
        assert abs(w[name].std().item() - 0.05) < 0.1 * 0.05, name
    assert torch.equal(w["layers.1.input_layernorm.weight"], torch.ones(config.hidden_size))
    assert not torch.equal(LlamaModel(config.replace(seed=8),
                                      pg_collection=current_groups()).word_embeddings.weight,
                           w["word_embeddings.weight"])


def test_biases_when_add_bias_linear():
    config = small_config(add_bias_linear=True)
    names = {n for n, _ in LlamaModel(config, pg_collection=current_groups()).named_parameters()}
    assert {"layers.0.self_attention.query_key_value.bias", "layers.0.self_attention.dense.bias",
            "layers.0.mlp.dense_h_to_4h.bias", "layers.0.mlp.dense_4h_to_h.bias"} <= names
    assert "output_layer.bias" not in names
    model = LlamaModel(small_config(), pg_collection=current_groups())
    assert not any(n.endswith(".bias") for n, _ in model.named_parameters())


def test_bf16_model_keeps_fp32_rotary_angles():
    config = small_config(params_dtype=torch.bfloat16, max_position_embeddings=4096)
    model = LlamaModel(config, pg_collection=current_groups()).eval()
    assert model.layers[0].mlp.dense_h_to_4h.weight.dtype == torch.bfloat16
    model.to(torch.bfloat16)
    assert model.rotary.inv_freq.dtype == torch.float32
    cos, _ = model.rotary(torch.tensor([[4000]]))
    assert cos.dtype == torch.float32
    assert torch.isclose(cos[0, 0, 0, 0], torch.tensor(math.cos(4000.0)), atol=1e-3)
    tokens, labels = batch(config, s=16)
    with torch.no_grad():
        assert model(tokens).dtype == torch.bfloat16
        assert model(tokens, labels=labels).dtype == torch.float32


def test_dropout_is_active_only_in_training():
    config = small_config(hidden_dropout=0.3)
    model = LlamaModel(config, pg_collection=current_groups())
    tokens, _ = batch(config, s=16)
    with torch.no_grad():
        train = model(tokens)
        model.eval()
        assert torch.equal(model(tokens), model(tokens))
        assert not torch.allclose(train, model(tokens))


def test_get_layer_numbers():
    assert get_layer_numbers(8, 2, 1) == [5, 6, 7, 8]
    assert get_layer_numbers(4, 1, 0) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size"):
        get_layer_numbers(6, 4, 0)


@pytest.mark.parametrize("changes,match", [
    ({"num_attention_heads": 6, "num_query_groups": 4}, "--num-query-groups"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"tensor_model_parallel_size": 2}, "initialize_model_parallel"),
    ({"context_parallel_size": 2}, r"context_parallel_size \(2\) differs from the size of the "
                                   r"context-parallel group"),
])
def test_bad_configs_fail_clearly(changes, match):
    with pytest.raises((ValueError, NotImplementedError, RuntimeError), match=match):
        LlamaModel(small_config(**changes), pg_collection=current_groups())


def test_attention_dropout_draws_from_the_tensor_parallel_rng_state():
    from megatron.core.tensor_parallel.random import get_rng_tracker, model_parallel_manual_seed
    config = small_config(attention_dropout=0.5)
    model = LlamaModel(config, pg_collection=current_groups())
    tokens, _ = batch(config, s=16)
    model_parallel_manual_seed(5, 0)
    default_state = torch.random.get_rng_state()
    tracker_state = get_rng_tracker().get_states()
    with torch.no_grad():
        first = model(tokens)
        # Attention dropout advanced the tracker's state, not the default generator.
        assert torch.equal(torch.random.get_rng_state(), default_state)
        get_rng_tracker().set_states(tracker_state)
        assert torch.equal(model(tokens), first)
        assert not torch.allclose(model(tokens), first)
        model.eval()
        assert torch.equal(model(tokens), model(tokens))


def test_flops_formula_counts_every_matmul():
    from megatron.model.flops import num_floating_point_operations
    c = small_config(kv_channels=12)
    b, s = 3, 40
    t = b * s
    nh, ng, d, h, f = c.num_attention_heads, c.num_query_groups, c.kv_channels, c.hidden_size, c.ffn_hidden_size
    per_layer = 2 * t * h * (nh + 2 * ng) * d + 2 * t * nh * d * h + 2 * 2 * t * s * nh * d \
        + 2 * t * h * 2 * f + 2 * t * f * h
    forward = c.num_layers * per_layer + 2 * t * h * c.padded_vocab_size
    assert num_floating_point_operations(c, b, s) == pytest.approx(3 * forward, rel=1e-12)
