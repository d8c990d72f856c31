"""HuggingFace <-> our checkpoints: logits equal transformers' at TP x PP in {1,2}^2, bitwise
round trips through a reshard, classic conversion mistakes caught, bad configs refused."""

import json
import os

import pytest
import torch

from tests.helpers.convert import (LLAMA3_SCALING, VOCAB, assert_logits_match, convert, make_hf,
                                   megatron_logits, safetensors_tensors, tokens_batch)
from tools.checkpoint import loader_hf

transformers = pytest.importorskip("transformers")

VARIANTS = {"gqa": {}, "tied": {"tie": True}, "llama3-rope-scaling": {"rope_scaling": LLAMA3_SCALING}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_dir(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(f"hf-{request.param}"))
    model = make_hf(folder, **VARIANTS[request.param])
    with torch.no_grad():
        expected = model(tokens_batch()).logits
    return folder, expected


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_to_megatron_logits_equal_transformers(hf_dir, tp, pp, tmp_path):
    folder, expected = hf_dir
    out = tmp_path / "ckpt"
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir", out,
            "--target-tensor-parallel-size", tp, "--target-pipeline-parallel-size", pp)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    logits = megatron_logits(str(out), tp, pp, tokens_batch())
    assert logits.shape == (2, 128, 256)  # 251 padded to a multiple of 128 x TP
    assert_logits_match(logits, expected)


_safetensors = safetensors_tensors


def test_round_trip_through_reshard_is_bitwise(hf_dir, tmp_path):
    folder, expected = hf_dir
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "a", "--target-tensor-parallel-size", 2, "--target-pipeline-parallel-size", 2)
    convert("--loader", "megatron", "--saver", "megatron", "--load-dir", tmp_path / "a",
            "--save-dir", tmp_path / "b", "--target-tensor-parallel-size", 1,
            "--target-pipeline-parallel-size", 1)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "b", "--save-dir",
            tmp_path / "hf", "--tokenizer-dir", folder, "--max-shard-size", "60KB")
    original, exported = _safetensors(folder), _safetensors(tmp_path / "hf")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    assert len([n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors")]) > 1
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == b"stand-in tokenizer bytes"
    # Every exported file has the mode of config.json (open() under the umask), shards too.
    modes = {n: os.stat(tmp_path / "hf" / n).st_mode & 0o777 for n in os.listdir(tmp_path / "hf")}
    assert set(modes.values()) == {modes["config.json"]}, modes
    reloaded = transformers.LlamaForCausalLM.from_pretrained(
        str(tmp_path / "hf"), attn_implementation="eager", trust_remote_code=False).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens_batch()).logits, expected)


def _meta_perm(w, n_heads):
    """Meta -> HF q/k row permutation (transformers' convert_llama_weights_to_hf): applying it
    to weights that are already in HF order is the classic double permutation."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


MISTAKES = {
    "qk-permuted": lambda l: dict(l, q=_meta_perm(l["q"], 8), k=_meta_perm(l["k"], 2)),
    "gate-up-swapped": lambda l: dict(l, gate=l["up"], up=l["gate"]),
    "group-order": lambda l: dict(l, k=torch.cat(l["k"].chunk(2)[::-1]), v=torch.cat(l["v"].chunk(2)[::-1])),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_classic_mistake_fails_the_comparison(mistake, tmp_path, monkeypatch):
    folder = str(tmp_path / "hf")
    model = make_hf(folder)
    with torch.no_grad():
        expected = model(tokens_batch()).logits
    original = loader_hf._stream

    def broken(weights, meta):
        for kind, payload in original(weights, meta):
            yield kind, MISTAKES[mistake](payload) if kind == "layer" else payload

    monkeypatch.setattr(loader_hf, "_stream", broken)
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ckpt", "--target-tensor-parallel-size", 2)
    with pytest.raises(AssertionError, match="logits differ"):
        assert_logits_match(megatron_logits(str(tmp_path / "ckpt"), 2, 1, tokens_batch()), expected)


@pytest.mark.parametrize("field,value,message", [
    ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "yarn"),
    ("hidden_act", "gelu", "hidden_act"),
    ("sliding_window", 4096, "sliding_window"),
])
def test_unsupported_config_fields_are_refused(field, value, message, tmp_path):
    folder = tmp_path / "hf"
    make_hf(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    cfg.pop("rope_parameters", None) if field == "rope_scaling" else None
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
                tmp_path / "out")
    assert not (tmp_path / "out" / "latest_checkpointed_iteration.txt").exists()


def test_fewer_query_groups_than_tp_fails_before_writing(tmp_path):
    folder = tmp_path / "hf"
    make_hf(str(folder), groups=1)
    with pytest.raises(ValueError, match="1 query groups"):
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
                tmp_path / "out", "--target-tensor-parallel-size", 2)
    assert not (tmp_path / "out").exists()
