"""Megatron-LLaMA checkpoints (built synthetically in its layout) convert exactly, and their pickled
args are read without running code."""

import argparse
import os

import pytest
import torch

from megatron.checkpointing import CheckpointError
from tests.helpers.convert import VOCAB, convert, make_hf
from tools.checkpoint.layout import fuse_gate_up, fuse_qkv, pad_vocab, split

TP, PP, LAYERS, PADDED = 2, 2, 4, 256


def megatron_llama_rng_state():
    """Megatron-LLaMA's ``rng_state`` entry: NumPy's state as NumPy pickles it (a uint32 array),
    Python's, torch's, and a NumPy scalar for good measure."""
    import random

    import numpy as np
    np.random.seed(11)
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
            "rng_tracker_states": {}, "np_scalar": np.float64(0.5), "np_int": np.int64(3)}


def write_megatron_llama(hf_dir, out, iteration=10):
    """Write ``hf_dir``'s model in Megatron-LLaMA's layout at TP=2, PP=2 (nested dicts, lm_head
    replicated, per-rank [Q; K; V] and [gate; up], _dp_000 folders, an argparse.Namespace)."""
    from safetensors.torch import load_file

    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    ns = argparse.Namespace(num_layers=LAYERS, hidden_size=64, ffn_hidden_size=96,
                            num_attention_heads=8, group_query_attention=True, num_query_groups=2,
                            kv_channels=8, max_position_embeddings=256, seq_length=128,
                            layernorm_epsilon=1e-6, rotary_base=50000.0, padded_vocab_size=PADDED,
                            tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP,
                            params_dtype=torch.float32, tokenizer_type="PretrainedFromHF")
    embed = split(pad_vocab(sd["model.embed_tokens.weight"], PADDED), TP, 0)
    folder = os.path.join(out, f"iter_{iteration:07d}")
    per_stage = LAYERS // PP
    for p in range(PP):
        for t in range(TP):
            encoder = {}
            for i in range(per_stage):
                g, pre = p * per_stage + i, f"layers.{i}."
                h = lambda n: sd[f"model.layers.{g}.{n}.weight"]  # noqa: E731
                encoder[pre + "input_layernorm.weight"] = h("input_layernorm")
                encoder[pre + "self_attention.query_key_value.weight"] = fuse_qkv(
                    h("self_attn.q_proj"), h("self_attn.k_proj"), h("self_attn.v_proj"), TP)[t]
                encoder[pre + "self_attention.dense.weight"] = split(h("self_attn.o_proj"), TP, 1)[t]
                encoder[pre + "post_attention_layernorm.weight"] = h("post_attention_layernorm")
                encoder[pre + "mlp.dense_h_to_4h.weight"] = fuse_gate_up(
                    h("mlp.gate_proj"), h("mlp.up_proj"), TP)[t]
                encoder[pre + "mlp.dense_4h_to_h.weight"] = split(h("mlp.down_proj"), TP, 1)[t]
            model = {"language_model": {"encoder": encoder}}
            if p == 0:
                model["language_model"]["embedding"] = {"word_embeddings": {"weight": embed[t]}}
            if p == PP - 1:
                encoder["final_layernorm.weight"] = sd["model.norm.weight"]
                model["lm_head.weight"] = pad_vocab(sd["lm_head.weight"], PADDED)
            path = os.path.join(folder, f"mp_rank_{t:02d}_{p:03d}_dp_000", "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path))
            torch.save({"model": model, "args": ns, "iteration": iteration,
                        "checkpoint_version": 3.0, "rng_state": [megatron_llama_rng_state()]}, path)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def test_megatron_llama_to_hf_is_bitwise(tmp_path):
    from safetensors.torch import load_file

    make_hf(str(tmp_path / "hf"), layers=LAYERS)
    write_megatron_llama(str(tmp_path / "hf"), str(tmp_path / "mllama"))
    convert("--loader", "megatron-llama", "--saver", "hf", "--load-dir", tmp_path / "mllama",
            "--save-dir", tmp_path / "out", "--true-vocab-size", VOCAB)
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)


def test_megatron_llama_without_true_vocab_size_refuses_hf_export(tmp_path):
    make_hf(str(tmp_path / "hf"), layers=LAYERS)
    write_megatron_llama(str(tmp_path / "hf"), str(tmp_path / "mllama"))
    with pytest.raises(ValueError, match="--true-vocab-size"):
        convert("--loader", "megatron-llama", "--saver", "hf", "--load-dir", tmp_path / "mllama",
                "--save-dir", tmp_path / "out")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_pickled_code_is_never_executed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ck" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": {}, "args": _Exploit()}, str(path))
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(CheckpointError, match="cannot read"):
        convert("--loader", "megatron-llama", "--saver", "hf", "--load-dir", tmp_path / "ck",
                "--save-dir", tmp_path / "out")
    assert not (tmp_path / "PWNED").exists()


def test_numpy_rng_state_loads_with_weights_only_allowlist(tmp_path):
    import numpy as np

    from tools.checkpoint.loader_megatron_llama import safe_load

    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"rng_state": [megatron_llama_rng_state()]}, path)
    with pytest.raises(Exception):  # the plain weights_only unpickler refuses NumPy objects
        torch.load(path, weights_only=True)
    state = safe_load(path)["rng_state"][0]
    kind, keys, pos, _, _ = state["np_rng_state"]
    np.random.seed(11)
    expected = np.random.get_state()
    assert kind == "MT19937" and keys.dtype == np.uint32 and pos == expected[2]
    assert np.array_equal(keys, expected[1]) and state["np_scalar"] == 0.5
    # anything beyond the listed reconstructors and dtypes is still refused
    torch.save({"rng_state": np.array([1.5], dtype=np.float16)}, path)
    with pytest.raises(CheckpointError, match="cannot read"):
        safe_load(path)
