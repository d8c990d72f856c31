"""The Megatron-LM mapping (:mod:`megatron.checkpointing.foreign.megatron_lm`) and ``--load`` of
Megatron-LM checkpoints, on the genuine ones of ``../shared/data/megatron-lm-reference``: the
per-group fused QKV is reordered to ours, the values their args lose come from flags or fail
naming the field, other architectures, layouts and model flags are refused naming what differs,
and ``--use-checkpoint-args`` takes the model shape over."""

import os
import re

import pytest
import torch

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.foreign import identify, megatron_lm
from tests.helpers.convert import megatron_lm_reference, megatron_lm_shard
from tests.helpers.dist import run_distributed


def test_fused_qkv_is_reordered_per_group(shared_data):
    from safetensors.torch import load_file

    root = megatron_lm_reference(shared_data)
    hf = load_file(os.path.join(root, "hf-llama-tiny", "model.safetensors"))
    want = torch.cat([hf[f"model.layers.2.self_attn.{n}_proj.weight"] for n in "qkv"])
    single = identify(megatron_lm_shard(root, "mcore-tp1pp1")).state["model"]["decoder.layers.2.self_attention.linear_qkv.weight"]
    assert not torch.equal(single, want)  # Megatron-LM's order is not ours...
    assert torch.equal(megatron_lm.qkv_to_ours(single, 8, 4, 8), want)  # ...and this maps it
    # TP=2: each rank holds two whole groups, in the per-group order again; stage 1's layer 0 is
    # layer 2 (stage-local numbering)
    parts = [megatron_lm.qkv_to_ours(identify(megatron_lm_shard(root, "mcore-tp2pp2", t, 1)).state["model"][
        "decoder.layers.0.self_attention.linear_qkv.weight"], 4, 2, 8) for t in range(2)]
    from tools.checkpoint.layout import unfuse_qkv
    assert all(torch.equal(a, b) for a, b in zip(unfuse_qkv(parts, 8, 4, 8), want.split([64, 32, 32])))


def test_values_the_args_lose_come_from_flags_or_fail(shared_data, capsys):
    args = dict(identify(megatron_lm_shard(megatron_lm_reference(shared_data), "mcore-tp1pp1")).args)
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
    from megatron.arguments import load_args_from_checkpoint, parse_args

    args = parse_args(["--load", os.path.join(megatron_lm_reference(shared_data), "mcore-tp2pp2"),
                       "--use-checkpoint-args", "--seq-length", "32"])
    changed = load_args_from_checkpoint(args)
    assert (args.num_query_groups, args.kv_channels, args.ffn_hidden_size, args.norm_epsilon) == (4, 8, 176, 1e-5)
    assert args.tensor_model_parallel_size == 2 and args.pipeline_model_parallel_size == 2
    assert "seq_length" not in changed and args.seq_length == 32  # Megatron-LM hard-codes 4096


def _load_at(load_dir, tp, pp):
    from megatron.checkpointing import load_checkpoint
    from megatron.config import CheckpointConfig, ModelConfig
    from megatron.core import parallel_state as ps
    from megatron.model.llama import LlamaModel

    groups = ps.initialize_model_parallel(tp, pp)
    model = LlamaModel(ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=176,
                                   num_attention_heads=8, num_query_groups=4, kv_channels=8,
                                   padded_vocab_size=1024, max_position_embeddings=128),
                       pg_collection=groups)
    try:
        load_checkpoint([model], None, None, CheckpointConfig(load=load_dir), groups,
                        run_flags=dict(num_layers=4, num_attention_heads=8,
                                       group_query_attention=True, num_query_groups=4))
    except CheckpointError as exc:
        return str(exc)
    return None


def test_another_layout_is_refused_with_the_command(shared_data):
    src = os.path.join(megatron_lm_reference(shared_data), "mcore-tp2pp2")
    message = run_distributed(1, _load_at, src, 1, 1)[0]
    assert message.startswith(f"--load {src} is a Megatron-LM checkpoint (Megatron-Core tensor "
                              "names) saved at TP=2, PP=2, but this run has TP=1, PP=1"), message
    assert ("--loader megatron --saver megatron --load-dir " + src) in message and "\n" not in message


def test_optimizer_state_needs_finetune(shared_data, tmp_path):
    """M1 with an ``optimizer`` entry, as a Megatron-LM training run saves one (its args re-saved
    as plain values: the file is otherwise M1's)."""
    import argparse
    import shutil

    from megatron.core.dist_checkpointing.safe_pickle import load_raw, to_plain

    src = os.path.join(megatron_lm_reference(shared_data), "mcore-tp1pp1")
    shutil.copytree(src, tmp_path / "m1", ignore=shutil.ignore_patterns("*.pt"))
    state = load_raw(megatron_lm_shard(megatron_lm_reference(shared_data), "mcore-tp1pp1"))
    state["args"] = argparse.Namespace(**to_plain(state["args"]))
    state["optimizer"] = {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": []}
    path = tmp_path / "m1" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    torch.save(state, path)  # the copied tree holds its folders
    message = run_distributed(1, _load_at, str(tmp_path / "m1"), 1, 1)[0]
    assert message == (f"{path} holds Megatron-LM optimizer state, which is not read; pass "
                       "--finetune (or --no-load-optim) to load the weights only"), message


def test_run_flags_must_match_the_checkpoint(shared_data):
    import argparse

    from megatron.checkpointing.foreign import check_run_matches

    ours = megatron_lm.our_args(identify(megatron_lm_shard(megatron_lm_reference(shared_data), "mcore-tp1pp1")).args, "M1")
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


def test_a_tensor_shape_contradicting_the_args_is_named():
    """Issue 31: such a tensor passed the mapping and failed later in torch's load_state_dict
    (a multi-line "size mismatch" RuntimeError) or in a reshape."""
    import torch

    from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
    from megatron.checkpointing.foreign import megatron_lm

    config = {"hidden_size": 8, "ffn_hidden_size": 12, "num_attention_heads": 4,
              "num_query_groups": 2, "kv_channels": 2, "untie_embeddings_and_output_weights": True}
    good = {"decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(8, 6),  # [h, f / TP] at TP 2
            "decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(8, 8),
            "embedding.word_embeddings.weight": torch.zeros(5, 8)}
    assert set(megatron_lm.to_our_state_dict(good, config, tp=2)) == {
        "layers.0.mlp.dense_4h_to_h.weight", "layers.0.self_attention.query_key_value.weight",
        "word_embeddings.weight"}
    for name, shape, want in (("decoder.layers.0.mlp.linear_fc2.weight", (8, 7), "[8, 6]"),
                              ("decoder.layers.0.self_attention.linear_qkv.weight", (8, 9),
                               "[8, 8]"),
                              ("embedding.word_embeddings.weight", (5, 9), "['vocab/TP', 8]"),
                              ("decoder.final_layernorm.weight", (8, 1), "[8]")):
        with pytest.raises(CheckpointError, match=re.escape(
                f"tensor {name} of the Megatron-LM checkpoint has shape {list(shape)}, but its own "
                "args (hidden_size 8, ffn_hidden_size 12, 4 heads in 2 groups of 2 channels, "
                f"TP 2) give {want}: the checkpoint contradicts its args")):
            megatron_lm.to_our_state_dict({name: torch.zeros(shape)}, config, tp=2)
