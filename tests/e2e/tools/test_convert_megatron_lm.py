"""Genuine Megatron-LM checkpoints (``../shared/data/megatron-lm-reference/checkpoints``, written by
Megatron-LM's own converter: M1 Megatron-Core names TP=1, M2 Megatron-Core names TP=2 x PP=2 with
stage-local layer numbers, M3 legacy ``language_model.encoder`` names TP=1; GQA 8 heads in 4
groups) convert to HF bitwise (``--loader megatron-lm``), load into our model directly and after
conversion to ours at another layout, and reproduce the expected logits."""

import json
import os

import pytest
import torch

from megatron.checkpointing import CheckpointError
from tests.helpers.convert import (assert_reproduces, convert, hf_logits, megatron_logits,
                                   megatron_lm_reference)

pytest.importorskip("transformers")

VECTORS = {"M1": ("mcore-tp1pp1", 1, 1), "M2": ("mcore-tp2pp2", 2, 2), "M3": ("legacy-tp1pp1", 1, 1)}


def _batch(root):
    with open(os.path.join(root, "mcore-tp1pp1", "expected.json")) as f:
        ids = torch.tensor(json.load(f)["batch"]["input_ids"])
    return ids, torch.load(os.path.join(root, "mcore-tp1pp1", "expected_logits.pt"), weights_only=True)


@pytest.mark.parametrize("vector", sorted(VECTORS))
def test_to_hf_is_bitwise_and_reproduces_the_logits(shared_data, tmp_path, vector):
    from safetensors.torch import load_file

    root = megatron_lm_reference(shared_data)
    flags = ["--max-position-embeddings", "128"] if vector == "M1" else []
    convert("--loader", "megatron-lm", "--saver", "hf", "--load-dir", os.path.join(root, VECTORS[vector][0]),
            "--save-dir", tmp_path / "hf", "--tokenizer-dir", os.path.join(root, "hf-llama-tiny"), *flags)
    source = load_file(os.path.join(root, "hf-llama-tiny", "model.safetensors"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(source) and len(source) == 39
    assert all(torch.equal(exported[k], source[k]) for k in source)
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (4, 8, 1024)
    assert (config["rms_norm_eps"], config["rope_theta"]) == (1e-5, 10000.0)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # from the tokenizer
    # Megatron-LM's HF loader records 4096 positions; --max-position-embeddings restores HF's
    assert config["max_position_embeddings"] == (128 if flags else 4096)
    ids, expected = _batch(root)
    logits = hf_logits(str(tmp_path / "hf"), ids)
    assert torch.equal(logits, hf_logits(os.path.join(root, "hf-llama-tiny"), ids))  # same model
    diff = (logits - expected).abs().max().item()
    print(f"{vector} -> HF: max |logit - expected| {diff:.3g}")
    assert diff <= 2e-5  # transformers here vs the vector's transformers 4.57.6: fp32 order


@pytest.mark.parametrize("vector", sorted(VECTORS))
def test_our_model_loads_it_directly(shared_data, vector):
    root = megatron_lm_reference(shared_data)
    name, tp, pp = VECTORS[vector]
    ids, expected = _batch(root)
    logits = megatron_logits(os.path.join(root, name), tp, pp, ids)
    exact = hf_logits(os.path.join(root, "hf-llama-tiny"), ids, torch.float64)
    diff = assert_reproduces(logits, expected, exact)
    print(f"{vector} read directly by our model at TP={tp} PP={pp}: max |logit - expected| {diff:.3g}")


def test_converted_to_ours_at_another_layout(shared_data, tmp_path):
    root = megatron_lm_reference(shared_data)
    convert("--loader", "megatron", "--saver", "megatron", "--load-dir", os.path.join(root, "mcore-tp2pp2"),
            "--save-dir", tmp_path / "ours", "--target-tensor-parallel-size", 1,
            "--target-pipeline-parallel-size", 2)
    saved = torch.load(tmp_path / "ours" / "release" / "mp_rank_00_000" / "model_optim_rng.pt",
                       weights_only=True)["args"]
    assert (saved["num_query_groups"], saved["norm_epsilon"], saved["true_vocab_size"]) == (4, 1e-5, 1024)
    ids, expected = _batch(root)
    logits = megatron_logits(str(tmp_path / "ours"), 1, 2, ids)
    exact = hf_logits(os.path.join(root, "hf-llama-tiny"), ids, torch.float64)
    print(f"M2 -> ours TP=1 PP=2: max |logit - expected| {assert_reproduces(logits, expected, exact):.3g}")


def test_flags_for_foreign_values_are_refused_on_our_checkpoints(tmp_path):
    from tests.helpers.convert import make_hf

    make_hf(str(tmp_path / "hf"))
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "ours")
    with pytest.raises(CheckpointError, match="is one of our checkpoints, which record their norm "
                                              "epsilon.*drop --norm-epsilon"):
        convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "ours",
                "--save-dir", tmp_path / "out", "--norm-epsilon", "1e-6")

