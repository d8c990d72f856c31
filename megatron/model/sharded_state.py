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

A mixture-of-experts layer (:class:`~megatron.core.transformer.moe.moe_layer.MoELayer`) saves
its grouped experts on a global expert axis: the local ``weight1 [E_local, 2f, h]`` and
``weight2 [E_local, h, f]`` of EP rank r are the box at offset ``r * E_local`` (the module's
``first_expert``) along dim 0 of the global ``layers.{n}.mlp.experts.weight1 [E, 2f, h]`` /
``weight2 [E, h, f]``, so expert e is row e whatever EP rank holds it and a checkpoint loads at
any EP size dividing E. Under expert-TP the slice of rank t is boxed into the same global
tensors: ``weight2``'s columns ``f_t`` are an offset along dim 2, and ``weight1``'s rows
``[gate_t; up_t]`` are two boxes per expert (rows ``t*f/etp`` of the gate half and of the up
half), so the checkpoint does not depend on expert-TP either. The router's ``weight [E, h]``, its ``expert_bias [E]`` buffer (state of
the aux-loss-free balancing) and the shared expert are dense tensors.

Every sharding takes this rank's :class:`~megatron.core.process_groups.ProcessGroupCollection`:
a dense parameter is partitioned over ``tp`` and replicated over ``dp_cp``; an expert parameter
(:func:`~megatron.core.distributed.expert_params.is_expert_param`) over ``expt_tp`` and
``expt_dp``; each box carries the ranks of its replica group, among which one writer is chosen.

A tensor-parallel partition is its slice of the global tensor along the parameter's
``partition_dim``; the fused weights, whose rows on rank r are ``[q_r; k_r; v_r]`` and
``[gate_r; up_r]`` (:mod:`megatron.core.transformer.initialization`), are split into their logical blocks,
each a contiguous slice of its own global tensor (modules declare theirs with
``fused_row_blocks()``). Parameters not partitioned over TP (norms) are written by TP rank 0; the
tied embedding's copy on the last pipeline stage (``word_embeddings_for_head``) is the same
global tensor as the first stage's ``word_embeddings`` and is written by the first stage only.
"""

from __future__ import annotations

import re
from typing import Dict, Tuple

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
    ``dp_cp``, or the expert grid's ``expt_tp`` and ``expt_dp``."""
    if not is_expert_param(p):
        return pg_collection.tp, pg_collection.dp_cp
    return pg_collection.expt_tp, pg_collection.expt_dp


def _expert_axes(model, pg_collection: ProcessGroupCollection) -> Dict[str, Tuple[int, int]]:
    """``{local parameter name: (E, first global expert)}`` of every grouped-experts weight
    (the parameters of :class:`~megatron.core.transformer.moe.experts.GroupedMLP` modules, dim 0
    the local experts; expert i of EP rank r is global expert ``r * E_local + i``, checked
    against the module's ``first_expert``).

    Raises:
        ValueError: a grouped expert weight at EP > 1 not marked as an expert parameter (its
            replicas would be taken over ``dp_cp``, which holds other experts), or a module whose
            ``first_expert`` is not ``ep_rank * E_local``.
    """
    ep = pg_collection.ep
    out = {}
    from megatron.core.transformer.moe.experts import GroupedMLP

    for prefix, module in model.named_modules():
        if not isinstance(module, GroupedMLP):
            continue
        local, first = module.num_local_experts, module.first_expert
        if first != ep.rank * local:
            raise ValueError(f"{prefix}: first expert {first} on EP rank {ep.rank} of "
                             f"{ep.size} with {local} local experts (expected {ep.rank * local})")
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if ep.size > 1 and not is_expert_param(p):
                raise ValueError(f"{full}: grouped expert weights at "
                                 f"--expert-model-parallel-size {ep.size} must be marked as "
                                 "expert parameters (mark_expert)")
            out[full] = (local * ep.size, first)
    return out


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
    experts = _expert_axes(model, pg_collection)
    out = {}
    for local, p in model.named_parameters():
        key = _global_name(model, local)
        tp, replicas = _grid(p, pg_collection)
        tp_rank, tp_size = tp.rank, tp.size
        if local in experts:
            total, first = experts[local]
            if tp_size > 1 and getattr(p, "partition_dim", None) == 1:  # [gate_t; up_t] rows
                out[local] = ParamSharding.expert_row_blocks(
                    key, 2, p.shape, total, first, tp_rank, tp_size,
                    replica_group=replicas.ranks)
            elif tp_size > 1:  # weight2's columns f_t
                out[local] = ParamSharding.expert_axis(
                    key, p.shape, total, first, replica_group=replicas.ranks,
                    partition_dim=p.partition_dim, tp_rank=tp_rank, tp_size=tp_size)
            else:  # not partitioned over expert-TP: expert-TP rank 0 writes
                out[local] = ParamSharding.expert_axis(
                    key, p.shape, total, first, replica_id=1 if tp_rank else 0,
                    replica_group=replicas.ranks)
            continue
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


# Buffers that are model state (saved and loaded with the weights): the router's expert bias.
_STATE_BUFFERS = ("expert_bias",)


def buffer_shardings(chunk, pg_collection: ProcessGroupCollection) -> Dict[str, ParamSharding]:
    """``{local buffer name: ParamSharding}`` of the state buffers (:data:`_STATE_BUFFERS`): whole
    tensors equal on every rank of a stage (the expert bias is updated from counts reduced over the
    whole batch), written by TP rank 0 of one ``dp_cp`` replica."""
    model = unwrap_model(chunk)
    tp = pg_collection.tp
    return {local: ParamSharding.partition(
                _global_name(model, local), b.shape, None, tp.rank, tp.size,
                replica_id=1 if tp.rank else 0, replica_group=pg_collection.dp_cp.ranks)
            for local, b in model.named_buffers()
            if b is not None and local.rsplit(".", 1)[-1] in _STATE_BUFFERS}


def model_sharded_tensors(model_chunks, pg_collection: ProcessGroupCollection,
                          prefix: str = "model."):
    """The boxes of every chunk's weights and state buffers (views of them: a load writes in
    place)."""
    boxes = []
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        named = dict(model.named_parameters())
        for local, sharding in param_shardings(chunk, pg_collection).items():
            boxes += sharding.boxes(named[local].data, prefix)
        buffers = dict(model.named_buffers())
        for local, sharding in buffer_shardings(chunk, pg_collection).items():
            boxes += sharding.boxes(buffers[local].data, prefix)
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
