"""Genuine Megatron-LLaMA checkpoints (``../shared/data/megatron-llama-reference``: V1, its
conversion tool's TP=2 release; V2, its training ``save_checkpoint`` at TP=2 x PP=2) convert to HF
bitwise and to ours, our model reproduces the expected logits, and the pickles inside are read as
plain data, never executed.

The other variants Megatron-LLaMA writes are built here from the genuine files, transformed exactly
as its code writes them (alibaba/Megatron-LLaMA 25306de):

- ``fp16``: ``tools/checkpoint_conversion/hf_to_megatron.sh``'s flags (TP 2, PP 1, DP 16, fp16).
  The tool casts each HF tensor with ``.to(dtype)`` before splitting it and records
  ``data_parallel_size`` and ``params_dtype`` in its ``SimpleNamespace``: V1's tensors (bitwise the
  HF ones) cast to fp16, its args with those two fields changed.
- ``dp``: ``save_checkpoint`` with ``--distributed-checkpointing``: data-parallel rank 0 of each
  (TP, PP) rank writes ``mp_rank_TT_PPP_dp_000/model_optim_rng.pt``
  (``get_rank_directory_name``): V2's files byte for byte in those folders.
- ``distopt``: the tool with ``--use_distributed_optimizer`` (TP 2, PP 1): the model files lose
  their dummy ``optimizer`` entry, which goes to ``release/mp_rank_0T_000/optim.pt`` instead.
"""

import json
import os
import shutil
import types

import pytest
import torch

from megatron.checkpointing import CheckpointError
from megatron.core.dist_checkpointing.safe_pickle import load_raw
from tests.helpers.convert import assert_reproduces, convert, hf_logits, megatron_logits

pytest.importorskip("transformers")

TOKENIZER = ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def _root(shared_data):
    return os.path.join(shared_data, "megatron-llama-reference")


def _cast(tree, dtype):
    return {k: _cast(v, dtype) if isinstance(v, dict) else v.to(dtype) for k, v in tree.items()}


def _start(src, out, tracker):
    os.makedirs(out)
    for name in TOKENIZER:
        shutil.copy(os.path.join(src, name), out)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(tracker)


def fp16_variant(root, out):
    v1 = os.path.join(root, "v1_tool_tp2pp1", "checkpoint")
    _start(v1, out, "release")
    for t in range(2):
        raw = load_raw(os.path.join(v1, "release", f"mp_rank_{t:02d}", "model_optim_rng.pt"))
        args = types.SimpleNamespace(**dict(vars(raw["args"]), data_parallel_size=16,
                                            params_dtype=torch.float16))
        path = os.path.join(out, "release", f"mp_rank_{t:02d}", "model_optim_rng.pt")
        os.makedirs(os.path.dirname(path))
        torch.save({"model": _cast(raw["model"], torch.float16), "checkpoint_version": 3.0,
                    "args": args, "optimizer": raw["optimizer"]}, path)


def dp_variant(root, out):
    v2 = os.path.join(root, "v2_train_tp2pp2", "checkpoint")
    _start(v2, out, "10")
    for name in os.listdir(os.path.join(v2, "iter_0000010")):
        target = os.path.join(out, "iter_0000010", name + "_dp_000")
        os.makedirs(target)
        shutil.copy(os.path.join(v2, "iter_0000010", name, "model_optim_rng.pt"), target)


def distopt_variant(root, out):
    v1 = os.path.join(root, "v1_tool_tp2pp1", "checkpoint")
    _start(v1, out, "release")
    for t in range(2):
        raw = load_raw(os.path.join(v1, "release", f"mp_rank_{t:02d}", "model_optim_rng.pt"))
        model_dir = os.path.join(out, "release", f"mp_rank_{t:02d}")
        optim_dir = os.path.join(out, "release", f"mp_rank_{t:02d}_000")  # the tool's naming
        for folder in (model_dir, optim_dir):
            os.makedirs(folder)
        torch.save({k: raw[k] for k in ("model", "checkpoint_version", "args")},
                   os.path.join(model_dir, "model_optim_rng.pt"))
        torch.save({"optimizer": raw["optimizer"]}, os.path.join(optim_dir, "optim.pt"))


@pytest.fixture(scope="module")
def vectors(shared_data, tmp_path_factory):
    """``{name: (checkpoint folder, extra convert flags, fp16)}``, genuine and transformed."""
    root, tmp = _root(shared_data), tmp_path_factory.mktemp("mllama")
    for name, build in (("fp16", fp16_variant), ("dp", dp_variant), ("distopt", distopt_variant)):
        build(root, str(tmp / name))
    eps = ["--norm-epsilon", "1e-6"]  # the conversion tool stores none
    return {"v1": (os.path.join(root, "v1_tool_tp2pp1", "checkpoint"), eps, False),
            "v2": (os.path.join(root, "v2_train_tp2pp2", "checkpoint"), [], False),
            "fp16": (str(tmp / "fp16"), eps, True), "dp": (str(tmp / "dp"), [], False),
            "distopt": (str(tmp / "distopt"), eps, False)}


@pytest.mark.parametrize("name", ["v1", "v2", "fp16", "dp", "distopt"])
def test_to_hf_is_bitwise_and_reproduces_the_logits(vectors, shared_data, tmp_path, name):
    from safetensors.torch import load_file

    root = _root(shared_data)
    folder, extra, fp16 = vectors[name]
    convert("--loader", "megatron-llama", "--saver", "hf", "--load-dir", folder, "--save-dir",
            tmp_path / "hf", *extra)
    source = load_file(os.path.join(root, "hf_source", "model.safetensors"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(source)
    want = {k: v.half() if fp16 else v for k, v in source.items()}
    assert all(torch.equal(exported[k], want[k]) for k in want)  # all 39 tensors bitwise
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    assert (config["rms_norm_eps"], config["rope_theta"], config["vocab_size"]) == (1e-6, 10000.0, 1000)
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (1, 2, 128)
    assert os.path.isfile(tmp_path / "hf" / "tokenizer.model")
    with open(os.path.join(root, "expected.json")) as f:
        ids = torch.tensor(json.load(f)["batch"]["input_ids"])
    ours = hf_logits(str(tmp_path / "hf"), ids)
    if fp16:
        assert torch.equal(ours, hf_logits(os.path.join(root, "hf_source"), ids, round_to=torch.float16))
        return
    expected = torch.load(os.path.join(root, "expected_logits.pt"), weights_only=True)
    assert torch.equal(ours, hf_logits(os.path.join(root, "hf_source"), ids))  # same model
    print(f"{name} -> HF: max |logit - expected| {(ours - expected).abs().max().item():.3g}")
    assert (ours - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("name, tp, pp", [("v1", 1, 1), ("v2", 2, 2)])
def test_to_ours_reproduces_the_logits(vectors, shared_data, tmp_path, name, tp, pp):
    root = _root(shared_data)
    folder, extra, _ = vectors[name]
    convert("--loader", "megatron-llama", "--saver", "megatron", "--load-dir", folder,
            "--save-dir", tmp_path / "ours", "--target-tensor-parallel-size", tp,
            "--target-pipeline-parallel-size", pp, *extra)
    saved = torch.load(tmp_path / "ours" / "release" / ("mp_rank_00" + ("_000" if pp > 1 else ""))
                       / "model_optim_rng.pt", weights_only=True)["args"]
    assert (saved["norm_epsilon"], saved["rotary_base"], saved["true_vocab_size"]) == (1e-6, 10000.0, 1000)
    with open(os.path.join(root, "expected.json")) as f:
        ids = torch.tensor(json.load(f)["batch"]["input_ids"])
    logits = megatron_logits(str(tmp_path / "ours"), tp, pp, ids)
    expected = torch.load(os.path.join(root, "expected_logits.pt"), weights_only=True)
    exact = hf_logits(os.path.join(root, "hf_source"), ids, torch.float64)
    diff = assert_reproduces(logits, expected, exact)
    print(f"{name} -> ours TP={tp} PP={pp}: max |logit - expected| {diff:.3g}")


def test_missing_epsilon_fails_naming_the_flag(vectors, tmp_path):
    folder = vectors["v1"][0]  # genuinely without it: the tool's args have 14 fields, no epsilon
    with pytest.raises(CheckpointError, match="does not record layernorm_epsilon; pass --norm-epsilon"):
        convert("--loader", "megatron-llama", "--saver", "hf", "--load-dir", folder,
                "--save-dir", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_pickles_read_as_plain_data(vectors):
    from megatron.checkpointing.foreign import MEGATRON_LLAMA, identify

    v1 = identify(os.path.join(vectors["v1"][0], "release", "mp_rank_01", "model_optim_rng.pt"))
    assert v1.system == MEGATRON_LLAMA and v1.args["params_dtype"] == "torch.float32"
    assert len(v1.args) == 14 and "layernorm_epsilon" not in v1.args
    v2 = identify(os.path.join(vectors["v2"][0], "iter_0000010", "mp_rank_01_001", "model_optim_rng.pt"))
    assert v2.args["model_type"] == "megatron.core.enums.ModelType(1)" and len(v2.args) == 235
    kind, keys, pos, _, _ = v2.state["rng_state"][0]["np_rng_state"]  # NumPy's own pickle
    assert kind == "MT19937" and keys.dtype.name == "uint32" and keys.shape == (624,)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_code_in_a_pickle_is_refused_naming_file_and_class(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ck" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": {}, "args": _Exploit()}, str(path))
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("release")
    for loader in ("megatron-llama", "megatron"):
        with pytest.raises(CheckpointError) as info:
            convert("--loader", loader, "--saver", "hf", "--load-dir", tmp_path / "ck",
                    "--save-dir", tmp_path / "out")
        message = str(info.value)
        assert f"{path} pickles the class {os.system.__module__}.system" in message, message
        assert "weights_only=False" not in message and "\n" not in message
    assert not (tmp_path / "PWNED").exists()
