"""The Megatron-LM MoE mapping and the torch_dist common-state reader on made-up tensors (no
shared data): local experts stacked in order and checked, the MoE settings not read refused by
name, Megatron-LM's expert-parallel shards (mapped to ours) joined and their copies checked, a common-state record that pickles
a callable refused without running it."""

import re

import pytest
import torch

from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
from megatron.checkpointing.foreign import megatron_lm

CONFIG = {"hidden_size": 4, "ffn_hidden_size": 6, "num_attention_heads": 2, "num_query_groups": 2,
          "kv_channels": 2, "untie_embeddings_and_output_weights": True, "num_experts": 4,
          "moe_ffn_hidden_size": 3, "expert_model_parallel_size": 2}


def _experts(first: int, count: int) -> dict:
    """Local experts 0..count-1 holding the values of global experts first...: fc1 [2f, h] filled
    with the global index, fc2 [h, f] with minus it."""
    out = {"decoder.layers.0.mlp.router.weight": torch.arange(16.).view(4, 4)}
    for i in range(count):
        e = float(first + i)
        out[f"decoder.layers.0.mlp.experts.local_experts.{i}.linear_fc1.weight"] = torch.full((6, 4), e)
        out[f"decoder.layers.0.mlp.experts.local_experts.{i}.linear_fc2.weight"] = torch.full((4, 3), -e)
        out[f"decoder.layers.0.mlp.experts.local_experts.{i}.linear_fc1._extra_state"] = None
    return out


def test_local_experts_are_stacked_in_order():
    ours = megatron_lm.to_our_state_dict(_experts(2, 2), CONFIG, tp=1)
    assert sorted(ours) == ["layers.0.mlp.experts.weight1", "layers.0.mlp.experts.weight2",
                            "layers.0.mlp.router.weight"]
    w1, w2 = ours["layers.0.mlp.experts.weight1"], ours["layers.0.mlp.experts.weight2"]
    assert w1.shape == (2, 6, 4) and w2.shape == (2, 4, 3)
    assert w1[:, 0, 0].tolist() == [2.0, 3.0] and w2[:, 0, 0].tolist() == [-2.0, -3.0]


def test_a_missing_local_expert_or_a_wrong_shape_is_named():
    shard = _experts(0, 2)
    del shard["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    with pytest.raises(CheckpointError, match=re.escape(
            "layers.0.mlp.experts.weight2: the Megatron-LM shard holds local experts [0], but "
            "its args (4 experts over expert-parallel size 2) give 2 per shard (0..1)")):
        megatron_lm.to_our_state_dict(shard, CONFIG, tp=1)
    shard = _experts(0, 2)
    shard["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] = torch.zeros(5, 4)
    with pytest.raises(CheckpointError, match=re.escape(
            "local_experts.0.linear_fc1.weight of the Megatron-LM checkpoint has shape [5, 4], "
            "but its args (hidden_size 4, moe_ffn_hidden_size 3) give [6, 4]")):
        megatron_lm.to_our_state_dict(shard, CONFIG, tp=1)


@pytest.mark.parametrize("field,value", [("moe_shared_expert_intermediate_size", 8),
                                         ("moe_layer_freq", [1, 0]),
                                         ("expert_tensor_parallel_size", 2)])
def test_moe_settings_not_read_are_refused_by_name(field, value):
    saved = {"num_layers": 2, "hidden_size": 4, "ffn_hidden_size": 6, "num_attention_heads": 2,
             "num_experts": 4, field: value}
    with pytest.raises(CheckpointError, match=re.escape(f"src has {field}={value!r}")):
        megatron_lm.moe_args(saved, "src")
    assert megatron_lm.moe_args(dict(saved, **{field: None if field != "moe_layer_freq" else 1}),
                                "src")["num_experts"] == 4


def test_expert_parallel_shards_join_and_their_copies_are_checked():
    from tools.checkpoint.moe_layout import ExpertError, join_expert_shards

    a = megatron_lm.to_our_state_dict(_experts(0, 2), CONFIG, tp=1)
    b = megatron_lm.to_our_state_dict(_experts(2, 2), CONFIG, tp=1)
    merged = join_expert_shards([a, b])
    assert merged["layers.0.mlp.experts.weight1"][:, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert torch.equal(merged["layers.0.mlp.router.weight"], a["layers.0.mlp.router.weight"])
    b["layers.0.mlp.router.weight"] = b["layers.0.mlp.router.weight"] + 1
    with pytest.raises(ExpertError, match="layers.0.mlp.router.weight differs between "
                                          "expert-parallel ranks 0 and 1"):
        join_expert_shards([a, b])


class _RunsCode:
    def __reduce__(self):
        return (print, ("ran",))


def test_a_common_state_record_that_pickles_a_callable_is_refused(tmp_path, capsys):
    import io

    from megatron.core.dist_checkpointing.safe_pickle import load_raw_bytes

    buffer = io.BytesIO()
    torch.save([{"args": _RunsCode(), "iteration": 1}], buffer)
    with pytest.raises(CheckpointError, match=r"__0_0.distcp \(record common_state/shard_0_1\) "
                                              r"pickles the class builtins.print"):
        load_raw_bytes(buffer.getvalue(), "__0_0.distcp (record common_state/shard_0_1)")
    assert "ran" not in capsys.readouterr().out
    buffer = io.BytesIO()
    torch.save([{"args": {"num_layers": 2}, "iteration": 1}], buffer)
    assert load_raw_bytes(buffer.getvalue(), "x")[0]["iteration"] == 1
