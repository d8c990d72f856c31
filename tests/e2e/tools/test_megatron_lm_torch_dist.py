"""Megatron-LM's own ``torch_dist`` checkpoint (``mcore-torch-dist-tp2pp2``: the tiny LLaMA saved
by Megatron-LM's ``save_checkpoint`` at TP=2 PP=2, fp32, layers stacked ``[L, ...]``, fused QKV
per query group, ``[gate; up]`` global ``linear_fc1``, the common state a byte record of
``__0_0.distcp``, no optimizer state) is read without anything from it running: its weights are
bit-equal to the vector's HF source; ``pretrain_llama.py --load`` reads it at its own layout and
at TP1 PP1, and the converter writes ours at TP1 and HF; every path gives the logits the
vector's ``expected.json`` says (transformers fp32 eager on ``hf-llama-tiny``:
``expected_logits.pt``, within what fp32 allows: :func:`assert_reproduces`)."""

import os

import pytest
import torch

from tests.helpers.convert import assert_reproduces, convert
from tests.helpers.megatron_lm_vectors import (COMMON, LLAMA_FLAGS, batch_and_expected,
                                               load_error, logits_after_load, vector)

pytest.importorskip("transformers")

NAME = "mcore-torch-dist-tp2pp2"
# HF name of each of our global per-layer keys
HF_LAYER = {"self_attention.query.weight": "self_attn.q_proj.weight",
            "self_attention.key.weight": "self_attn.k_proj.weight",
            "self_attention.value.weight": "self_attn.v_proj.weight",
            "self_attention.dense.weight": "self_attn.o_proj.weight",
            "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
            "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
            "input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "post_attention_layernorm.weight"}


def _folder(shared_data):
    return os.path.join(vector(shared_data, NAME), "torch_dist", "iter_0000001")


def test_weights_keys_and_common_state_read_safely(shared_data):
    from safetensors.torch import load_file

    from megatron.checkpointing.foreign import megatron_lm_dist as mlm_dist

    folder = _folder(shared_data)
    metadata = mlm_dist.read_metadata(folder)
    keys = mlm_dist.weight_keys(metadata)
    assert keys["decoder.layers.self_attention.linear_qkv.weight"][0] == (4, 128, 64)
    assert keys["decoder.layers.mlp.linear_fc1.weight"][0] == (4, 352, 64)
    assert len(keys) == 9 and not mlm_dist.has_optimizer_state(metadata)
    common = mlm_dist.read_common(folder, metadata)
    assert (common["iteration"], common["checkpoint_version"]) == (1, 3.0)
    assert common["args"]["tensor_model_parallel_size"] == 2 and common["args"]["vocab_size"] is None
    assert common["args"]["model_type"] == "megatron.core.enums.ModelType(1)"  # an inert stand-in
    ours, tensors = mlm_dist.whole_model(folder)
    hf = load_file(os.path.join(vector(shared_data, NAME), "hf-llama-tiny", "model.safetensors"))
    expected = {"word_embeddings.weight": "model.embed_tokens.weight",
                "final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
    expected.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}"
                     for i in range(4) for k, v in HF_LAYER.items()})
    assert sorted(tensors) == sorted(expected) and len(expected) == len(hf) == 39
    assert all(torch.equal(tensors[k], hf[v]) for k, v in expected.items())


def test_read_as_the_wrong_qkv_order_would_differ(shared_data):
    """The per-group QKV order matters here (2 query heads per group): reading the fused rows as
    [Q; K; V] blocks gives other weights."""
    from megatron.checkpointing.foreign import megatron_lm_dist as mlm_dist

    folder = _folder(shared_data)
    metadata = mlm_dist.read_metadata(folder)
    raw = mlm_dist.read_weights(folder, metadata)["decoder.layers.self_attention.linear_qkv.weight"]
    _, tensors = mlm_dist.whole_model(folder)
    assert not torch.equal(raw[0][:64], tensors["layers.0.self_attention.query.weight"])


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 1)])
def test_load_at_its_own_layout_and_another(shared_data, tp, pp):
    root = vector(shared_data, NAME)
    ids, expected, exact = batch_and_expected(root)
    argv = [*LLAMA_FLAGS, *COMMON, "--load", os.path.join(root, "torch_dist"),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--global-batch-size", "1"]
    logits, iteration = logits_after_load(argv, tp * pp, ids)
    diff = assert_reproduces(logits, expected, exact)
    print(f"torch_dist --load at TP={tp} PP={pp}: max |logit - expected| {diff:.3g}")
    assert iteration == 0


def test_load_refuses_another_model(shared_data):
    root = vector(shared_data, NAME)
    ids, _, _ = batch_and_expected(root)
    flags = list(LLAMA_FLAGS)
    flags[flags.index("--num-query-groups") + 1] = "2"
    message = load_error([*flags, *COMMON, "--load", os.path.join(root, "torch_dist"),
                          "--global-batch-size", "1"], 1, ids)
    assert message is not None and "num_query_groups=4" in message, message
    assert "--num-query-groups 2" in message and "\n" not in message, message


@pytest.mark.parametrize("saver,tp,pp", [("megatron", 1, 1), ("megatron", 2, 2), ("hf", 1, 1)])
def test_convert(shared_data, tmp_path, saver, tp, pp):
    from safetensors.torch import load_file

    root = vector(shared_data, NAME)
    ids, expected, exact = batch_and_expected(root)
    out = tmp_path / saver
    extra = (["--tokenizer-dir", os.path.join(root, "hf-llama-tiny"), "--max-position-embeddings",
              "128", "--true-vocab-size", "1024"] if saver == "hf" else
             ["--target-tensor-parallel-size", tp, "--target-pipeline-parallel-size", pp])
    convert("--loader", "megatron-lm", "--saver", saver, "--load-dir", os.path.join(root, "torch_dist"),
            "--save-dir", out, *extra)
    if saver == "hf":
        source = load_file(os.path.join(root, "hf-llama-tiny", "model.safetensors"))
        exported = load_file(str(out / "model.safetensors"))
        assert sorted(exported) == sorted(source)
        assert all(torch.equal(exported[k], source[k]) for k in source)  # so the logits are HF's
        return
    logits, _ = logits_after_load([*LLAMA_FLAGS, *COMMON, "--load", str(out), "--finetune",
                                   "--tensor-model-parallel-size", str(tp),
                                   "--pipeline-model-parallel-size", str(pp),
                                   "--global-batch-size", "1"], tp * pp, ids)
    diff = assert_reproduces(logits, expected, exact)
    print(f"torch_dist -> ours TP{tp} PP{pp}: max |logit - expected| {diff:.3g}")


def test_use_checkpoint_args_and_the_inference_loader(shared_data):
    from tests.helpers.convert import megatron_logits

    root = vector(shared_data, NAME)
    ids, expected, exact = batch_and_expected(root)
    load = os.path.join(root, "torch_dist")
    # the model flags from the checkpoint's own args (epsilon, theta given: it records 4096
    # positions and Megatron's defaults only)
    logits, _ = logits_after_load([*COMMON, "--load", load, "--use-checkpoint-args",
                                   "--global-batch-size", "1"], 1, ids)
    diff = assert_reproduces(logits, expected, exact)
    served = megatron_logits(load, 2, 1, ids)  # generation's loader, at TP2 PP1
    served_diff = assert_reproduces(served, expected, exact)
    print(f"--use-checkpoint-args: {diff:.3g}; inference loader TP2: {served_diff:.3g}")


def test_a_metadata_asking_for_a_callable_is_refused_and_nothing_runs(shared_data, tmp_path):
    """The same checkpoint with ``torch.Size`` in its ``.metadata`` pickle renamed to
    ``posix.kill`` (same lengths): --load says so in one line, naming the file and the global."""
    import shutil

    root = vector(shared_data, NAME)
    ids, _, _ = batch_and_expected(root)
    copy = tmp_path / "torch_dist"
    shutil.copytree(os.path.join(root, "torch_dist"), copy)
    metadata = copy / "iter_0000001" / ".metadata"
    os.chmod(metadata, 0o644)
    data = metadata.read_bytes()
    original = b"\x8c\x05torch\x94\x8c\x04Size"
    assert data.count(original) == 1
    metadata.write_bytes(data.replace(original, b"\x8c\x05posix\x94\x8c\x04kill"))
    message = load_error([*LLAMA_FLAGS, *COMMON, "--load", str(copy), "--global-batch-size", "1"],
                         1, ids)
    assert message is not None and "\n" not in message, message
    assert f"{metadata} asks to build posix.kill" in message and "refused" in message, message


def _with_optimizer_state(root: str, tmp_path) -> str:
    """A copy of the vector whose ``.metadata`` also lists an ``optimizer.state.exp_avg.*``
    tensor (the record of ``output_layer.weight`` under a second key), as a Megatron-LM training
    checkpoint with optimizer state lists its moments."""
    import dataclasses
    import pickle
    import shutil

    from megatron.checkpointing.foreign import megatron_lm_dist as mlm_dist

    copy = tmp_path / "with_optimizer"
    shutil.copytree(os.path.join(root, "torch_dist"), copy)
    folder = copy / "iter_0000001"
    metadata = mlm_dist.read_metadata(str(folder))
    key, moment = "output_layer.weight", "optimizer.state.exp_avg.output_layer.weight"
    metadata.state_dict_metadata[moment] = metadata.state_dict_metadata[key]
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == key:
            metadata.storage_data[dataclasses.replace(index, fqn=moment)] = info
    os.chmod(folder / ".metadata", 0o644)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    assert mlm_dist.has_optimizer_state(mlm_dist.read_metadata(str(folder)))
    return str(copy)


def test_optimizer_state_needs_finetune(shared_data, tmp_path):
    root = vector(shared_data, NAME)
    ids, expected, exact = batch_and_expected(root)
    load = _with_optimizer_state(root, tmp_path)
    argv = [*LLAMA_FLAGS, *COMMON, "--load", load, "--global-batch-size", "1"]
    message = load_error(argv, 1, ids)
    assert message is not None and "holds Megatron-LM optimizer state, which is not read; pass " \
        "--finetune (or --no-load-optim)" in message, message
    logits, _ = logits_after_load(argv + ["--finetune"], 1, ids)
    assert_reproduces(logits, expected, exact)
