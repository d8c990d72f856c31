"""Weights drawn per block from ``(seed, layer, name[, expert])``: a block's values do not
depend on the other blocks' sizes or draws, on which rank builds it, or on the default
generator; an expert's block drawn alone is the one every layout draws."""

import torch

from megatron.core.transformer.initialization import (derive_seed, from_fused_layout, init_block,
                                           normal_block_init)
from megatron.model.llama import LlamaModel
from tests.helpers.groups import current_groups
from tests.helpers.model import small_config


def _blocks(model, config):
    layer = model.layers[0]
    d, nh, ng, f = (config.kv_channels, config.num_attention_heads, config.num_query_groups,
                    config.ffn_hidden_size)
    q, k, v = from_fused_layout(layer.self_attention.query_key_value.weight,
                                [nh * d, ng * d, ng * d], 1)
    gate, up = from_fused_layout(layer.mlp.dense_h_to_4h.weight, [f, f], 1)
    return {"query": q, "key": k, "value": v, "gate": gate, "up": up,
            "dense": layer.self_attention.dense.weight}


def test_a_block_does_not_depend_on_the_sizes_of_the_others():
    """More query heads (same groups, same head width) leave key, value and the MLP unchanged;
    fewer groups leave the query block; the fused draws are not one stream."""
    base = small_config(kv_channels=8)
    ref = _blocks(LlamaModel(base, pg_collection=current_groups()), base)
    more_heads = base.replace(num_attention_heads=16)
    fewer_groups = base.replace(num_query_groups=1)
    got_heads = _blocks(LlamaModel(more_heads, pg_collection=current_groups()), more_heads)
    got_groups = _blocks(LlamaModel(fewer_groups, pg_collection=current_groups()), fewer_groups)
    for name in ("key", "value", "gate", "up"):
        assert torch.equal(got_heads[name], ref[name]), name
    # The first rows of a longer block are the shorter block (one generator per block).
    assert torch.equal(got_heads["query"][:ref["query"].shape[0]], ref["query"])
    for name in ("query", "gate", "up", "dense"):
        assert torch.equal(got_groups[name], ref[name]), name
    assert torch.equal(got_groups["key"], ref["key"][:got_groups["key"].shape[0]])
    assert not torch.equal(ref["key"], ref["value"])


def test_each_block_is_its_own_seeded_draw():
    config = small_config()
    model = LlamaModel(config, pg_collection=current_groups())
    blocks = _blocks(model, config)
    gen = torch.Generator().manual_seed(derive_seed(config.seed, 1, "mlp.up"))
    expected = torch.empty_like(blocks["up"]).normal_(0.0, config.init_method_std, generator=gen)
    assert torch.equal(blocks["up"], expected)
    # The embedding's real rows: the seeded draw of [vocab, h] (here vocab = padded).
    gen = torch.Generator().manual_seed(derive_seed(config.seed, 0, "word_embeddings"))
    emb = model.word_embeddings.weight
    assert torch.equal(emb, torch.empty_like(emb).normal_(0.0, config.init_method_std,
                                                          generator=gen))


def test_an_expert_drawn_alone_is_the_expert_of_every_layout():
    """A rank holding experts 2 and 3 of 4 builds them alone; the whole set, built in any order
    by one rank, holds the same tensors; experts differ from one another and from the dense
    block of the same name."""
    shape, std = (24, 16), 0.02
    alone = [init_block(shape, std, 7, 3, "mlp.experts.fc1", expert=e) for e in (2, 3)]
    torch.manual_seed(0)
    everything = {e: init_block(shape, std, 7, 3, "mlp.experts.fc1", expert=e)
                  for e in (3, 1, 0, 2)}
    assert torch.equal(alone[0], everything[2]) and torch.equal(alone[1], everything[3])
    assert not torch.equal(everything[0], everything[1])
    assert not torch.equal(init_block(shape, std, 7, 3, "mlp.experts.fc1"), everything[0])
    assert init_block(shape, std, 7, 3, "x", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_a_meta_tensor_is_left_alone():
    t = torch.empty(4, 4, device="meta")
    assert normal_block_init(0.02, 1, 1, "x")(t) is t
