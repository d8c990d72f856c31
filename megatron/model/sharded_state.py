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

Every sharding takes this rank's :class:`~megatron.core.process_groups.ProcessGroupCollection`:
a dense parameter is partitioned over ``tp`` and replicated over ``dp_cp``; an expert parameter
(:func:`~megatron.core.distributed.expert_params.is_expert_param`) over ``expt_tp`` and
``expt_dp``; each box carries the ranks of its replica group, among which one writer is chosen.

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
from megatron.core.distributed.expert_params import is_expert_param
from megatron.core.process_groups import ProcessGroupCollection
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


def _grid(p, pg_collection: ProcessGroupCollection):
    """``(tensor-parallel group, replica group)`` of a parameter: the dense grid's ``tp`` and
    ``dp_cp``, or the expert grid's ``expt_tp`` and ``expt_dp``.

    Raises:
        ValueError: an expert parameter at EP > 1 (each EP rank's experts need global keys of
            their own, which the layers holding experts give; not built yet).
    """
    if not is_expert_param(p):
        return pg_collection.tp, pg_collection.dp_cp
    if pg_collection.ep.size > 1:
        raise ValueError(f"distributed checkpoints of expert parameters at "
                         f"--expert-model-parallel-size {pg_collection.ep.size} are not "
                         "supported yet (experts need global keys per expert); save with EP 1")
    return pg_collection.expt_tp, pg_collection.expt_dp


def param_shardings(chunk, pg_collection: ProcessGroupCollection) -> Dict[str, ParamSharding]:
    """``{local parameter name: ParamSharding}`` of one model chunk (DDP wrappers are unwrapped).

    Args:
        chunk: a :class:`~megatron.model.llama.LlamaModel` (one pipeline stage or virtual stage),
            possibly wrapped.
        pg_collection: this rank's groups: each parameter's tensor-parallel rank and size, and
            its replica group (:func:`_grid`).
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
        tp, replicas = _grid(p, pg_collection)
        tp_rank, tp_size = tp.rank, tp.size
        if local in fused:
            prefix, rows = fused[local]
            gprefix = _global_name(model, prefix + ".x")[:-1]
            suffix = local[len(prefix) + 1:].split(".", 1)[1]  # "weight" of "query_key_value.weight"
            out[local] = ParamSharding.row_blocks(
                [(f"{gprefix}{block}.{suffix}", n) for block, n in rows], p.shape, tp_rank,
                tp_size, replica_group=replicas.ranks)
            continue
        partitioned = bool(getattr(p, "tensor_model_parallel", False))
        replica = 1 if local.startswith("word_embeddings_for_head.") else 0
        if not partitioned and tp_rank:
            replica = 1
        out[local] = ParamSharding.partition(
            key, p.shape, p.partition_dim if partitioned else None, tp_rank, tp_size,
            replica_id=replica, resizable=key in _VOCABULARY, replica_group=replicas.ranks)
    return out


def model_shardings(model_chunks, pg_collection: ProcessGroupCollection
                    ) -> Dict[torch.nn.Parameter, ParamSharding]:
    """``{parameter: ParamSharding}`` over all chunks of this rank (the optimizers' view)."""
    out = {}
    for chunk in model_chunks:
        named = dict(unwrap_model(chunk).named_parameters())
        for local, sharding in param_shardings(chunk, pg_collection).items():
            out.setdefault(named[local], sharding)
    return out


def model_sharded_tensors(model_chunks, pg_collection: ProcessGroupCollection,
                          prefix: str = "model."):
    """The boxes of every chunk's weights (views of the parameters: a load writes in place)."""
    boxes = []
    for chunk in model_chunks:
        named = dict(unwrap_model(chunk).named_parameters())
        for local, sharding in param_shardings(chunk, pg_collection).items():
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
