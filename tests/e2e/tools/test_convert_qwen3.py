"""Qwen3 (dense, per-head q/k RMSNorm) checkpoints in and out: a tiny random
``Qwen3ForCausalLM`` (fp32) converted to our layout gives transformers' logits at TP1, TP2 and
PP2 and its first training loss; HF -> ours (TP2 x PP2) -> HF is bitwise and reloads as Qwen3;
at TP2 the q/k norm weights (the same on every tensor rank, each rank's heads giving part of
their gradient) train exactly as at TP1."""

import json

import pytest
import torch

from tests.helpers.convert import (HF_MODEL_FLAGS, convert, megatron_logits,
                                   one_document_dataset, reference_logits, save_random_hf,
                                   safetensors_tensors)
from tests.helpers.dist import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 32


def make_qwen3(folder: str):
    """A random fp32 Qwen3 (8 heads of width 8 in 2 groups, ffn 96, untied) with std-0.2 weights
    and norm weights 1 +- 0.1, saved with ``save_pretrained``; returns the model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(4)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    return save_random_hf(Qwen3ForCausalLM, config, folder)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3"))
    model = make_qwen3(folder)
    return (folder, model) + reference_logits(model, VOCAB)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_qwen3_logits_equal_transformers(qwen3, tp, pp, tmp_path, capsys):
    folder, _, tokens, expected = qwen3
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ckpt", "--target-tensor-parallel-size", tp,
            "--target-pipeline-parallel-size", pp)
    assert "--qk-layernorm" in capsys.readouterr().out
    logits = megatron_logits(str(tmp_path / "ckpt"), tp, pp, tokens)[..., :VOCAB]
    assert expected.abs().max() > 1.0  # far from uniform: the comparison has teeth
    diff = (logits - expected).abs().max().item()
    assert diff <= 3e-5, diff


def test_qwen3_round_trip_is_bitwise_and_reloads(qwen3, tmp_path):
    folder, model, tokens, expected = qwen3
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "a", "--target-tensor-parallel-size", 2, "--target-pipeline-parallel-size", 2)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "a", "--save-dir",
            tmp_path / "hf")
    original, exported = safetensors_tensors(folder), safetensors_tensors(tmp_path / "hf")
    assert sorted(original) == sorted(exported)
    assert any(k.endswith("self_attn.q_norm.weight") for k in exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(reloaded).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, expected)


FLAGS = HF_MODEL_FLAGS + [
    "--qk-layernorm",
    "--seq-length", str(SEQ), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
    "--make-vocab-size-divisible-by", "128", "--micro-batch-size", "1", "--global-batch-size", "1",
    "--train-iters", "3", "--lr", "0.01", "--min-lr", "0.01", "--split", "100,0,0",
    "--log-interval", "1", "--eval-iters", "0", "--seed", "5", "--num-workers", "0", "--finetune",
]


def _train(argv):
    import pretrain_llama
    return pretrain_llama.main(argv)


def test_qk_norm_at_tp2_trains_like_tp1(qwen3, tmp_path):
    """Three Adam steps (lr 0.01) from the converted checkpoint at TP1 and at TP2: the first
    loss is transformers', the losses agree, and the exported q/k norm weights agree with
    each other (to fp32 rounding) after moving away from the source's: at TP2 each rank's heads
    give part of their gradient, summed over the tensor ranks."""
    folder, model, _, _ = qwen3
    prefix = str(tmp_path / "data")
    doc = one_document_dataset(prefix, SEQ, VOCAB)
    runs = {}
    for tp in (1, 2):
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
                tmp_path / f"ours{tp}", "--target-tensor-parallel-size", tp)
        argv = FLAGS + ["--load", str(tmp_path / f"ours{tp}"), "--data-path", prefix,
                        "--data-cache-path", str(tmp_path / "cache"), "--save",
                        str(tmp_path / f"run{tp}"), "--tensor-model-parallel-size", str(tp)]
        history = run_distributed(tp, _train, argv, timeout=300)[0]
        convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / f"run{tp}",
                "--save-dir", tmp_path / f"back{tp}")
        runs[tp] = history["lm loss"], safetensors_tensors(tmp_path / f"back{tp}")
    labels = torch.cat([doc[1:], doc[:1]])
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(model(doc[None]).logits[0], labels).item()
    assert abs(runs[1][0][0] - hf_loss) < 1e-5, (runs[1][0], hf_loss)
    assert len(runs[2][0]) == 3
    assert max(abs(a - b) for a, b in zip(runs[1][0], runs[2][0])) < 1e-4, runs
    original = safetensors_tensors(folder)
    for name in ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"):
        one, two = runs[1][1][name], runs[2][1][name]
        assert (one - original[name]).abs().max() > 1e-3  # training moved them: the test has teeth
        assert torch.allclose(one, two, atol=1e-5, rtol=0), (one - two).abs().max()
