"""The model in global coordinates for distributed checkpoints: the boxes of a TP=2 model and of
pipeline stages (tied embedding copy included) assemble into the TP=1 model's weights under the
documented global names; q/k/v and gate/up are separate global tensors; every element has
exactly one writer."""

import torch

from megatron.core.transformer.initialization import from_fused_layout
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.model import small_config


def _boxes(model):
    from megatron.model.sharded_state import model_sharded_tensors

    return [(b.key, b.global_shape, b.global_offset, b.data.clone(), b.replica_id, b.resizable)
            for b in model_sharded_tensors([model], current_groups())]


def _tp_rank(config):
    from megatron.core import parallel_state
    from megatron.model.llama import LlamaModel

    parallel_state.initialize_model_parallel(2, 1)
    model = LlamaModel(config.replace(tensor_model_parallel_size=2), pg_collection=current_groups())
    return _boxes(model)


def _expected(config):
    """The TP=1 model's tensors under the global names."""
    from megatron.model.llama import LlamaModel

    model = LlamaModel(config, pg_collection=current_groups())
    d, nh, ng, f = (config.kv_channels, config.num_attention_heads, config.num_query_groups,
                    config.ffn_hidden_size)
    out = {}
    for name, p in model.named_parameters():
        if "query_key_value" in name:
            q, k, v = from_fused_layout(p.detach(), [nh * d, ng * d, ng * d], 1)
            base = name.replace("query_key_value.weight", "")
            out.update({base + "query.weight": q, base + "key.weight": k, base + "value.weight": v})
        elif "dense_h_to_4h" in name:
            gate, up = from_fused_layout(p.detach(), [f, f], 1)
            out.update({name.replace("dense_h_to_4h", "gate"): gate,
                        name.replace("dense_h_to_4h", "up"): up})
        else:
            out[name] = p.detach()
    return model, out


def _assemble(boxes):
    tensors = {}
    for key, shape, offset, data, replica, _ in boxes:
        full = tensors.setdefault(key, torch.full(shape, float("nan")))
        region = full[tuple(slice(o, o + n) for o, n in zip(offset, data.shape))]
        if replica:
            assert torch.equal(region, data) or torch.isnan(region).all()
            continue
        assert torch.isnan(region).all(), f"{key}: written twice"
        region.copy_(data)
    return tensors


def test_tp2_boxes_are_the_tp1_model_under_global_names():
    config = small_config(untie_embeddings_and_output_weights=True)
    model, expected = _expected(config)
    ranks = run_distributed(2, _tp_rank, config)
    got = _assemble(ranks[0] + ranks[1])
    assert sorted(got) == sorted("model." + k for k in expected)
    assert "model.layers.1.self_attention.key.weight" in got and "model.layers.0.mlp.up.weight" in got
    for key, value in expected.items():
        assert torch.equal(got["model." + key], value), key
    resizable = {key for r in ranks for key, *_, flag in r if flag}
    assert resizable == {"model.word_embeddings.weight", "model.output_layer.weight"}
    norms = [b for b in ranks[1] if "layernorm" in b[0]]
    assert norms and all(b[4] == 1 for b in norms)  # TP duplicates: written by TP rank 0 only


def test_pipeline_stages_use_global_layer_numbers_and_write_the_tied_embedding_once():
    from megatron.model.llama import LlamaModel

    config = small_config(num_layers=4, untie_embeddings_and_output_weights=False)
    _, expected = _expected(config)
    groups = current_groups()
    first = LlamaModel(config, pg_collection=groups, pre_process=True, post_process=False,
                       layer_numbers=[1, 2])
    last = LlamaModel(config, pg_collection=groups, pre_process=False, post_process=True,
                      layer_numbers=[3, 4])
    boxes = _boxes(first) + _boxes(last)
    assert [b[0] for b in _boxes(last)][:1] == ["model.layers.2.input_layernorm.weight"]
    head = [b for b in _boxes(last) if b[0] == "model.word_embeddings.weight"]
    assert len(head) == 1 and head[0][4] == 1  # the last stage's copy is a replica
    got = _assemble(boxes)
    assert sorted(got) == sorted("model." + k for k in expected)
    for key, value in expected.items():
        assert torch.equal(got["model." + key], value), key
