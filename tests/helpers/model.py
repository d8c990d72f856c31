"""Small LLaMA configs, random HuggingFace twins (std-0.2 weights) and batches for model tests."""

import pytest
import torch

from megatron.config import ModelConfig
from megatron.core.transformer.initialization import to_fused_layout
from megatron.model.llama import LlamaModel

transformers = pytest.importorskip("transformers")


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def small_config(**changes) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                num_query_groups=2, padded_vocab_size=80, max_position_embeddings=64,
                norm_epsilon=1e-6, rotary_base=50000.0, seed=7)
    base.update(changes)
    return ModelConfig(**base)


def hf_model(config: ModelConfig, vocab_size=None):
    """A random HF LLaMA of the same shape, weights large enough that attention is far from
    uniform (std 0.2, random norm weights)."""
    hf_cfg = transformers.LlamaConfig(
        vocab_size=vocab_size or config.padded_vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
        head_dim=config.kv_channels, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon, rope_theta=config.rotary_base,
        rope_scaling=config.rope_scaling,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        attention_dropout=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
    return model


def copy_hf_into_ours(ours: LlamaModel, hf, tp: int = 1, rank: int = 0):
    """Load HF weights into our model at TP=tp (this rank's partitions)."""
    def part(t, dim):
        return t.chunk(tp, dim=dim)[rank]

    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        ours.word_embeddings.weight.copy_(part(sd["model.embed_tokens.weight"], 0))
        for i, layer in enumerate(ours.layers):
            p = f"model.layers.{i}."
            qkv = to_fused_layout([sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"],
                                   sd[p + "self_attn.v_proj.weight"]], tp)
            layer.self_attention.query_key_value.weight.copy_(part(qkv, 0))
            layer.self_attention.dense.weight.copy_(part(sd[p + "self_attn.o_proj.weight"], 1))
            gate_up = to_fused_layout([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], tp)
            layer.mlp.dense_h_to_4h.weight.copy_(part(gate_up, 0))
            layer.mlp.dense_4h_to_h.weight.copy_(part(sd[p + "mlp.down_proj.weight"], 1))
            layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])
        ours.final_layernorm.weight.copy_(sd["model.norm.weight"])
        if ours.config.untie_embeddings_and_output_weights:
            ours.output_layer.weight.copy_(part(sd["lm_head.weight"], 0))


def batch(config, b=2, s=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.padded_vocab_size, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

