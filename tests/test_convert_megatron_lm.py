"""Genuine Megatron-LM checkpoints (``../shared/data/megatron-lm-reference/checkpoints``, written by
Megatron-LM's own converter: M1 Megatron-Core names TP=1, M2 Megatron-Core names TP=2 x PP=2 with
stage-local layer numbers, M3 legacy ``language_model.encoder`` names TP=1; GQA 8 heads in 4
groups) convert to HF bitwise, load into our model directly and after conversion to ours, and
reproduce the expected logits; the per-group fused QKV is reordered to ours; the values their
args lose come from flags or fail naming the field."""

import json
import os

import pytest
import torch

from megatron.checkpointing import CheckpointError
from megatron.foreign_checkpoints import identify, megatron_lm
from tests.convert_helpers import assert_reproduces, convert, hf_logits, megatron_logits
from tests.dist import run_distributed

pytest.importorskip("transformers")

VECTORS = {"M1": ("mcore-tp1pp1", 1, 1), "M2": ("mcore-tp2pp2", 2, 2), "M3": ("legacy-tp1pp1", 1, 1)}


def _root(shared_data):
    return os.path.join(shared_data, "megatron-lm-reference", "checkpoints")


def _batch(root):
    with open(os.path.join(root, "mcore-tp1pp1", "expected.json")) as f:
        ids = torch.tensor(json.load(f)["batch"]["input_ids"])
    return ids, torch.load(os.path.join(root, "mcore-tp1pp1", "expected_logits.pt"), weights_only=True)


def _shard(root, name, t=0, p=None):
    sub = f"mp_rank_{t:02d}" + ("" if p is None else f"_{p:03d}")
    return os.path.join(root, name, "iter_0000001", sub, "model_optim_rng.pt")


@pytest.mark.parametrize("vector", sorted(VECTORS))
def test_to_hf_is_bitwise_and_reproduces_the_logits(shared_data, tmp_path, vector):
    from safetensors.torch import load_file

    root = _root(shared_data)
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
    root = _root(shared_data)
    name, tp, pp = VECTORS[vector]
    ids, expected = _batch(root)
    logits = megatron_logits(os.path.join(root, name), tp, pp, ids)
    exact = hf_logits(os.path.join(root, "hf-llama-tiny"), ids, torch.float64)
    diff = assert_reproduces(logits, expected, exact)
    print(f"{vector} read directly by our model at TP={tp} PP={pp}: max |logit - expected| {diff:.3g}")


def test_converted_to_ours_at_another_layout(shared_data, tmp_path):
    root = _root(shared_data)
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


def test_fused_qkv_is_reordered_per_group(shared_data):
    from safetensors.torch import load_file

    root = _root(shared_data)
    hf = load_file(os.path.join(root, "hf-llama-tiny", "model.safetensors"))
    want = torch.cat([hf[f"model.layers.2.self_attn.{n}_proj.weight"] for n in "qkv"])
    single = identify(_shard(root, "mcore-tp1pp1")).state["model"]["decoder.layers.2.self_attention.linear_qkv.weight"]
    assert not torch.equal(single, want)  # Megatron-LM's order is not ours...
    assert torch.equal(megatron_lm.qkv_to_ours(single, 8, 4, 8), want)  # ...and this maps it
    # TP=2: each rank holds two whole groups, in the per-group order again; stage 1's layer 0 is
    # layer 2 (stage-local numbering)
    parts = [megatron_lm.qkv_to_ours(identify(_shard(root, "mcore-tp2pp2", t, 1)).state["model"][
        "decoder.layers.0.self_attention.linear_qkv.weight"], 4, 2, 8) for t in range(2)]
    from tools.checkpoint.layout import unfuse_qkv
    assert all(torch.equal(a, b) for a, b in zip(unfuse_qkv(parts, 8, 4, 8), want.split([64, 32, 32])))


def test_values_the_args_lose_come_from_flags_or_fail(shared_data, capsys):
    args = dict(identify(_shard(_root(shared_data), "mcore-tp1pp1")).args)
    assert megatron_lm.our_args(args, "M1")["norm_epsilon"] == 1e-5
    notes = []
    ours = megatron_lm.our_args(args, "M1", {"rotary_base": 500000.0}, notes)
    assert ours["rotary_base"] == 500000.0 and notes == ["--rotary-base 500000.0 overrides rotary_base=10000 of M1"]
    for field, flag in (("layernorm_epsilon", "--norm-epsilon"), ("rotary_base", "--rotary-base")):
        lost = {k: v for k, v in args.items() if k != field}
        with pytest.raises(CheckpointError, match=f"M1 does not record (norm_epsilon or )?{field}; pass {flag}"):
            megatron_lm.our_args(lost, "M1")
        assert megatron_lm.our_args(lost, "M1", {"norm_epsilon": 1e-6, "rotary_base": 1e4})
    with pytest.raises(CheckpointError, match="M1 has normalization='LayerNorm'; this LLaMA"):
        megatron_lm.our_args(dict(args, normalization="LayerNorm"), "M1")
    with pytest.raises(CheckpointError, match="normalization='LayerNorm'"):  # older: not recorded
        megatron_lm.our_args({k: v for k, v in args.items() if k != "normalization"}, "M1")


def test_checkpoint_args_are_taken_over(shared_data):
    from megatron.arguments import parse_args
    from megatron.checkpointing import load_args_from_checkpoint

    args = parse_args(["--load", os.path.join(_root(shared_data), "mcore-tp2pp2"),
                       "--use-checkpoint-args", "--seq-length", "32"])
    changed = load_args_from_checkpoint(args)
    assert (args.num_query_groups, args.kv_channels, args.ffn_hidden_size, args.norm_epsilon) == (4, 8, 176, 1e-5)
    assert args.tensor_model_parallel_size == 2 and args.pipeline_model_parallel_size == 2
    assert "seq_length" not in changed and args.seq_length == 32  # Megatron-LM hard-codes 4096


def _load_at(load_dir, tp, pp):
    import argparse

    from megatron.checkpointing import load_checkpoint
    from megatron.config import ModelConfig
    from megatron.core import parallel_state as ps
    from megatron.model.llama import LlamaModel

    ps.initialize_model_parallel(tp, pp)
    model = LlamaModel(ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=176,
                                   num_attention_heads=8, num_query_groups=4, kv_channels=8,
                                   padded_vocab_size=1024, max_position_embeddings=128))
    try:
        load_checkpoint([model], None, None, argparse.Namespace(
            load=load_dir, num_layers=4, num_attention_heads=8, group_query_attention=True,
            num_query_groups=4))
    except CheckpointError as exc:
        return str(exc)
    return None


def test_another_layout_is_refused_with_the_command(shared_data):
    src = os.path.join(_root(shared_data), "mcore-tp2pp2")
    message = run_distributed(1, _load_at, src, 1, 1)[0]
    assert message.startswith(f"--load {src} is a Megatron-LM checkpoint (Megatron-Core tensor "
                              "names) saved at TP=2, PP=2, but this run has TP=1, PP=1"), message
    assert ("--loader megatron --saver megatron --load-dir " + src) in message and "\n" not in message


def test_optimizer_state_needs_finetune(shared_data, tmp_path):
    """M1 with an ``optimizer`` entry, as a Megatron-LM training run saves one (its args re-saved
    as plain values: the file is otherwise M1's)."""
    import argparse
    import shutil

    from megatron.foreign_checkpoints.safe_pickle import load_raw, to_plain

    src = os.path.join(_root(shared_data), "mcore-tp1pp1")
    shutil.copytree(src, tmp_path / "m1", ignore=shutil.ignore_patterns("*.pt"))
    state = load_raw(_shard(_root(shared_data), "mcore-tp1pp1"))
    state["args"] = argparse.Namespace(**to_plain(state["args"]))
    state["optimizer"] = {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": []}
    path = tmp_path / "m1" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    torch.save(state, path)  # the copied tree holds its folders
    message = run_distributed(1, _load_at, str(tmp_path / "m1"), 1, 1)[0]
    assert message == (f"{path} holds Megatron-LM optimizer state, which is not read; pass "
                       "--finetune (or --no-load-optim) to load the weights only"), message


def test_run_flags_must_match_the_checkpoint(shared_data):
    import argparse

    from megatron.foreign_checkpoints import check_run_matches

    ours = megatron_lm.our_args(identify(_shard(_root(shared_data), "mcore-tp1pp1")).args, "M1")
    run = dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=8,
               group_query_attention=True, num_query_groups=4, kv_channels=8,
               untie_embeddings_and_output_weights=True)
    check_run_matches(ours, argparse.Namespace(**run), "M1")
    # 4 heads of 16 channels in 2 groups have the same tensor shapes ((4 + 2*2) * 16 = 128 QKV
    # rows, 64 attention channels): only the flags tell them apart
    other = dict(run, num_attention_heads=4, num_query_groups=2, kv_channels=16)
    with pytest.raises(CheckpointError, match="M1 has num_attention_heads=8 but this run has "
                                              "--num-attention-heads 4"):
        check_run_matches(ours, argparse.Namespace(**other), "M1")


def test_flags_for_foreign_values_are_refused_on_our_checkpoints(tmp_path):
    from tests.convert_helpers import make_hf

    make_hf(str(tmp_path / "hf"))
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "ours")
    with pytest.raises(CheckpointError, match="is one of our checkpoints, which record their norm "
                                              "epsilon.*drop --norm-epsilon"):
        convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "ours",
                "--save-dir", tmp_path / "out", "--norm-epsilon", "1e-6")
