"""The one place that knows how logical LLaMA weights map onto tensor-parallel partitions.

Converters exchange weights in the *logical* (HuggingFace) form: ``q [nh*d, h]``, ``k, v
[ng*d, h]``, ``o [h, nh*d]``, ``gate, up [f, h]``, ``down [h, f]``, norms ``[h]``, and the word
embedding / output layer with the *true* vocabulary rows ``[V, h]``. Our checkpoints (and
Megatron-LLaMA's) hold, per tensor-parallel rank r of T:

- ``query_key_value``: ``[Q heads of rank r; K groups of rank r; V groups of rank r]``
  (:func:`megatron.core.transformer.initialization.to_fused_layout`);
- ``dense_h_to_4h``: ``[gate rows of rank r; up rows of rank r]``;
- ``dense`` / ``dense_4h_to_h``: column (input) partitions; embedding / output layer: row
  partitions of the vocabulary padded to ``padded_vocab_size`` with zero rows.

HuggingFace's q/k rows are already in the half-rotation (``rotate_half``) order our rotary
embedding uses, so no q/k permutation is applied in either direction.

Shapes: h = hidden, d = head width, nh = query heads, ng = query groups, f = ffn width, T = TP size.
"""

from __future__ import annotations

import os
from typing import Dict, List

import torch

from megatron.core.dist_checkpointing import checkpoint_io
from megatron.core.transformer.initialization import from_fused_layout, to_fused_layout

# Logical per-layer tensor names, in the order converters stream them.
LAYER_KEYS = ("input_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def split(t: torch.Tensor, tp: int, dim: int) -> List[torch.Tensor]:
    """``tp`` equal contiguous partitions of ``t`` along ``dim`` (cloned, so each can be saved
    alone without dragging the whole tensor's storage into its file)."""
    if t.shape[dim] % tp:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} cannot be split over "
                         f"tensor-parallel size {tp}")
    return [p.clone() for p in t.chunk(tp, dim=dim)]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int) -> List[torch.Tensor]:
    """Per-rank fused QKV weights ``[(nh + 2 ng) d / T, h]`` from logical q, k, v."""
    return split(to_fused_layout([q, k, v], tp), tp, 0)


def unfuse_qkv(parts: List[torch.Tensor], num_heads: int, num_groups: int, kv_channels: int):
    """Inverse of :func:`fuse_qkv`: ``(q, k, v)`` from the T per-rank fused weights."""
    d = kv_channels
    return from_fused_layout(torch.cat(parts, 0), [num_heads * d, num_groups * d, num_groups * d],
                             len(parts))


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, tp: int) -> List[torch.Tensor]:
    """Per-rank fused SwiGLU input weights ``[2 f / T, h]`` (``[gate of rank; up of rank]``)."""
    return split(to_fused_layout([gate, up], tp), tp, 0)


def unfuse_gate_up(parts: List[torch.Tensor], ffn_hidden_size: int):
    """Inverse of :func:`fuse_gate_up`: ``(gate, up)``."""
    f = ffn_hidden_size
    return from_fused_layout(torch.cat(parts, 0), [f, f], len(parts))


def pad_vocab(weight: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Append zero rows up to ``padded_vocab_size`` (generation masks those ids out)."""
    extra = padded_vocab_size - weight.shape[0]
    if extra < 0:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows exceeds the padded size "
                         f"{padded_vocab_size}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])], 0)


def unpad_vocab(weight: torch.Tensor, true_vocab_size: int) -> torch.Tensor:
    """The first ``true_vocab_size`` rows (the padding rows must never leak into an export)."""
    if weight.shape[0] < true_vocab_size:
        raise ValueError(f"embedding has {weight.shape[0]} rows, fewer than the true vocabulary "
                         f"size {true_vocab_size}")
    return weight[:true_vocab_size]


def layer_to_partitions(layer: Dict[str, torch.Tensor], tp: int,
                        expert_tp: int = 1) -> List[Dict[str, torch.Tensor]]:
    """Logical layer tensors -> one state dict per tensor-parallel rank, keys relative to the
    layer (``self_attention.query_key_value.weight``, ...), as in ``LlamaModel``. A MoE layer's
    routed experts are whole on every rank at ``expert_tp`` 1, split over the tensor ranks at
    ``expert_tp`` = ``tp`` (:func:`tools.checkpoint.moe_layout.split_experts`)."""
    qkv = fuse_qkv(layer["q"], layer["k"], layer["v"], tp)
    dense = split(layer["o"], tp, 1)
    parts = [{"input_layernorm.weight": layer["input_norm"],
              "self_attention.query_key_value.weight": qkv[r],
              "self_attention.dense.weight": dense[r],
              "post_attention_layernorm.weight": layer["post_norm"]} for r in range(tp)]
    if "q_bias" in layer:  # --add-qkv-bias: fused like the weight
        for r, b in enumerate(fuse_qkv(layer["q_bias"], layer["k_bias"], layer["v_bias"], tp)):
            parts[r]["self_attention.query_key_value.bias"] = b
    if "q_norm" in layer and layer["q_norm"].shape[0] == layer["q"].shape[0]:
        # --qk-layernorm-full-width (OLMoE): [nh d] and [ng d], sharded with the heads
        for p, qn, kn in zip(parts, split(layer["q_norm"], tp, 0), split(layer["k_norm"], tp, 0)):
            p.update({"self_attention.q_layernorm.weight": qn,
                      "self_attention.k_layernorm.weight": kn})
    elif "q_norm" in layer:  # --qk-layernorm: [d], the same on every rank
        for p in parts:
            p.update({"self_attention.q_layernorm.weight": layer["q_norm"],
                      "self_attention.k_layernorm.weight": layer["k_norm"]})
    if "router" in layer:  # a MoE layer: experts replicated over tensor ranks, or split
        from tools.checkpoint.moe_layout import split_experts, to_ours
        moe = to_ours(layer)
        if expert_tp == 1:
            return [dict(p, **moe) for p in parts]
        return [{**p, **moe, **split} for p, split in zip(parts, split_experts(moe, expert_tp))]
    gate_up = fuse_gate_up(layer["gate"], layer["up"], tp)
    down = split(layer["down"], tp, 1)
    for r, p in enumerate(parts):
        p.update({"mlp.dense_h_to_4h.weight": gate_up[r], "mlp.dense_4h_to_h.weight": down[r]})
    return parts


def partitions_to_layer(parts: List[Dict[str, torch.Tensor]], meta: dict) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`layer_to_partitions` (``meta`` gives heads, groups, kv_channels, ffn)."""
    q, k, v = unfuse_qkv([p["self_attention.query_key_value.weight"] for p in parts],
                         meta["num_attention_heads"], meta["num_query_groups"], meta["kv_channels"])
    layer = {"input_norm": parts[0]["input_layernorm.weight"], "q": q, "k": k, "v": v,
             "o": torch.cat([p["self_attention.dense.weight"] for p in parts], 1),
             "post_norm": parts[0]["post_attention_layernorm.weight"]}
    if meta.get("add_qkv_bias"):
        layer["q_bias"], layer["k_bias"], layer["v_bias"] = unfuse_qkv(
            [p["self_attention.query_key_value.bias"] for p in parts], meta["num_attention_heads"],
            meta["num_query_groups"], meta["kv_channels"])
    if meta.get("qk_layernorm") and meta.get("qk_layernorm_full_width"):  # sharded with heads
        layer.update({name: torch.cat([p[f"self_attention.{name[0]}_layernorm.weight"]
                                       for p in parts]) for name in ("q_norm", "k_norm")})
    elif meta.get("qk_layernorm"):
        layer.update(q_norm=parts[0]["self_attention.q_layernorm.weight"],
                     k_norm=parts[0]["self_attention.k_layernorm.weight"])
    if meta.get("num_experts") and "mlp.router.weight" in parts[0]:  # dense layers may interleave
        from tools.checkpoint.moe_layout import from_ours
        layer.update(from_ours(parts, meta))
        return layer
    gate, up = unfuse_gate_up([p["mlp.dense_h_to_4h.weight"] for p in parts], meta["ffn_hidden_size"])
    layer.update(gate=gate, up=up, down=torch.cat([p["mlp.dense_4h_to_h.weight"] for p in parts], 1))
    return layer


def check_layout(meta: dict, tp: int, pp: int, ep: int = 1, expert_tp: int = 1) -> None:
    """Refuse a target layout before anything is written.

    Raises:
        ValueError: heads, query groups, ffn width or layers not divisible by the target sizes;
            an expert-parallel size ``ep`` > 1 for a dense model or not dividing the experts;
            an expert-tensor-parallel size ``expert_tp`` > 1 for a dense model, other than 1 and
            ``tp``, or not dividing the experts' width.
    """
    if expert_tp > 1 and not meta.get("num_experts"):
        raise ValueError(f"--target-expert-tensor-parallel-size {expert_tp}: the model is dense "
                         "(no experts); drop the flag")
    if expert_tp not in (1, tp):
        raise ValueError(f"--target-expert-tensor-parallel-size {expert_tp}: only 1 or the "
                         f"target tensor-parallel size ({tp}) are written (a legacy checkpoint "
                         "splits experts over its tensor ranks); choose 1 or "
                         f"--target-tensor-parallel-size {expert_tp}")
    if expert_tp > 1 and meta["moe_ffn_hidden_size"] % expert_tp:
        raise ValueError(f"--target-expert-tensor-parallel-size {expert_tp} does not divide the "
                         f"experts' ffn hidden size {meta['moe_ffn_hidden_size']}")
    if ep > 1 and not meta.get("num_experts"):
        raise ValueError(f"--target-expert-parallel-size {ep}: the model is dense (no experts); "
                         "drop the flag")
    if ep > 1 and meta["num_experts"] % ep:
        raise ValueError(f"--target-expert-parallel-size {ep} does not divide the "
                         f"{meta['num_experts']} experts; choose a divisor of {meta['num_experts']}")
    problems = []
    if meta["num_attention_heads"] % tp:
        problems.append(f"{meta['num_attention_heads']} attention heads")
    if meta["num_query_groups"] % tp:
        problems.append(f"{meta['num_query_groups']} query groups (key/value heads; each "
                        "tensor-parallel rank must own whole groups, replication is not supported)")
    if meta["ffn_hidden_size"] % tp and not meta.get("num_experts"):
        problems.append(f"ffn hidden size {meta['ffn_hidden_size']}")
    if problems:
        raise ValueError(f"--target-tensor-parallel-size {tp} does not divide: "
                         + "; ".join(problems) + ". Choose a tensor-parallel size dividing them")
    if meta["num_layers"] % pp:
        raise ValueError(f"--target-pipeline-parallel-size {pp} does not divide the "
                         f"{meta['num_layers']} layers")


def load_torch_file(path: str) -> dict:
    """A weights file (``pytorch_model*.bin``, a Megatron shard), memory-mapped when it is in the
    zip format, so only the tensors actually read are paged in
    (:func:`megatron.core.dist_checkpointing.checkpoint_io.load_torch_file`: CRCs checked, tensors and plain values only).

    Raises:
        megatron.core.dist_checkpointing.checkpoint_io.UnreadableFileError: missing, damaged or refused (names the file).
    """
    return checkpoint_io.load_torch_file(path, what="weights file", mmap=True)


def find_file(folder: str, names) -> str | None:
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None
