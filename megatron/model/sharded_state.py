"""The LLaMA model's parameters in global, layout-free coordinates, for distributed checkpoints.

:func:`param_shardings` maps every parameter of one model chunk (a pipeline stage, or a virtual
stage of one) to a :class:`~megatron.core.dist_checkpointing.mapping.ParamSharding`. Global keys
are the module names of a TP = PP = 1 model, with global 0-based layer indices::

    word_embeddings.weight                          [v, h]   (the padded vocabulary v: resizable)
    layers.{n}.input_layernorm.weight               [h]
    layers.{n}.self_attention.query.weight          [nh*d, h]  \\
    layers.{n}.self_attention.key.weight            [ng*d, h]   } our fused query_key_value
    layers.{n}.self_attention.value.weight          [ng*d, h]  /
    layers.{n}.self_attention.dense.weight          [h, nh*d]
    layers.{n}.post_attention_layernorm.weight      [h]
    layers.{n}.mlp.gate.weight                      [f, h]    \\ our fused dense_h_to_4h
    layers.{n}.mlp.up.weight                        [f, h]    /
    layers.{n}.mlp.dense_4h_to_h.weight             [h, f]
    final_layernorm.weight                          [h]
    output_layer.weight                             [v, h]   (untied embeddings)

A tensor-parallel partition is its slice of the global tensor along the parameter's
``partition_dim``; the fused weights, whose rows on rank r are ``[q_r; k_r; v_r]`` and
``[gate_r; up_r]`` (:mod:`megatron.model.initialization`), are split into their logical blocks,
each a contiguous slice of its own global tensor (modules declare theirs with
``fused_row_blocks()``). Parameters not partitioned over TP (norms) are written by TP rank 0; the
tied embedding's copy on the last pipeline stage (``word_embeddings_for_head``) is the same
global tensor as the first stage's ``word_embeddings`` and is written by the first stage only.
"""

from __future__ import annotations

import re
from typing import Dict

import torch

from megatron.core.dist_checkpointing.mapping import ParamSharding
from megatron.model import unwrap_model

# Global tensors whose first dimension is the padded vocabulary (padding depends on TP).
_VOCABULARY = ("word_embeddings.weight", "output_layer.weight")


def _global_name(model, local: str) -> str:
    """``layers.{i}.x`` (local index) -> ``layers.{layer_number - 1}.x``; the tied copy on the
    last stage -> ``word_embeddings.x``."""
    match = re.match(r"layers\.(\d+)\.(.*)", local)
    if match:
        number = model.layers[int(match.group(1))].layer_number
        return f"layers.{number - 1}.{match.group(2)}"
    if local.startswith("word_embeddings_for_head."):
        return "word_embeddings." + local[len("word_embeddings_for_head."):]
    return local


def param_shardings(chunk, tp_rank: int, tp_size: int) -> Dict[str, ParamSharding]:
    """``{local parameter name: ParamSharding}`` of one model chunk (DDP wrappers are unwrapped).

    Args:
        chunk: a :class:`~megatron.model.llama.LlamaModel` (one pipeline stage or virtual stage),
            possibly wrapped.
        tp_rank, tp_size: this rank's tensor-parallel rank and the tensor-parallel size.
    """
    model = unwrap_model(chunk)
    fused = {}
    for prefix, module in model.named_modules():
        blocks = getattr(module, "fused_row_blocks", None)
        if blocks is not None:
            for name, rows in blocks().items():
                fused[f"{prefix}.{name}" if prefix else name] = (prefix, rows)
    out = {}
    for local, p in model.named_parameters():
        key = _global_name(model, local)
        if local in fused:
            prefix, rows = fused[local]
            gprefix = _global_name(model, prefix + ".x")[:-1]
            suffix = local[len(prefix) + 1:].split(".", 1)[1]  # "weight" of "query_key_value.weight"
            out[local] = ParamSharding.row_blocks(
                [(f"{gprefix}{block}.{suffix}", n) for block, n in rows], p.shape, tp_rank, tp_size)
            continue
        partitioned = bool(getattr(p, "tensor_model_parallel", False))
        replica = 1 if local.startswith("word_embeddings_for_head.") else 0
        if not partitioned and tp_rank:
            replica = 1
        out[local] = ParamSharding.partition(
            key, p.shape, p.partition_dim if partitioned else None, tp_rank, tp_size,
            replica_id=replica, resizable=key in _VOCABULARY)
    return out


def model_shardings(model_chunks, tp_rank: int, tp_size: int) -> Dict[torch.nn.Parameter, ParamSharding]:
    """``{parameter: ParamSharding}`` over all chunks of this rank (the optimizers' view)."""
    out = {}
    for chunk in model_chunks:
        named = dict(unwrap_model(chunk).named_parameters())
        for local, sharding in param_shardings(chunk, tp_rank, tp_size).items():
            out.setdefault(named[local], sharding)
    return out


def model_sharded_tensors(model_chunks, tp_rank: int, tp_size: int, prefix: str = "model."):
    """The boxes of every chunk's weights (views of the parameters: a load writes in place)."""
    boxes = []
    for chunk in model_chunks:
        named = dict(unwrap_model(chunk).named_parameters())
        for local, sharding in param_shardings(chunk, tp_rank, tp_size).items():
            boxes += sharding.boxes(named[local].data, prefix)
    return boxes


# Fused parameters of our modules and the global tensors they are saved as (module docstring).
_FUSED = {"self_attention.query_key_value": ("self_attention.query", "self_attention.key",
                                             "self_attention.value"),
          "mlp.dense_h_to_4h": ("mlp.gate", "mlp.up")}


def single_process_state_dict(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The state dict of a TP = PP = 1 model from whole global tensors ``{key: tensor}`` (keys
    without the ``model.`` prefix): the fused weights rebuilt in their TP = 1 layout (the blocks
    concatenated)."""
    block_of = {block: (fused, blocks) for fused, blocks in _FUSED.items() for block in blocks}
    out = {}
    for key, value in tensors.items():
        match = re.fullmatch(r"(layers\.\d+\.)(\w+\.\w+)\.(\w+)", key)
        if match is None or match.group(2) not in block_of:
            out[key] = value
            continue
        layer, block, suffix = match.groups()
        fused, blocks = block_of[block]
        if f"{layer}{fused}.{suffix}" not in out:
            out[f"{layer}{fused}.{suffix}"] = torch.cat(
                [tensors[f"{layer}{b}.{suffix}"] for b in blocks], dim=0)
    return out
