"""NVIDIA Megatron-LM's own ``torch_dist`` checkpoints (Megatron-Core distributed checkpoints,
its default ``--ckpt-format`` since Megatron-Core 0.8), read into ours at any TP / PP layout.

What Megatron-LM writes in ``iter_*`` (the reference vector ``mcore-torch-dist-tp2pp2``):

- ``metadata.json``: ``{"sharded_backend": "torch_dist", ...}`` without our ``format_version``;
- ``.metadata``: ``torch.distributed.checkpoint``'s index, a pickle (with Megatron-Core's cached
  save plan), read by :func:`megatron.core.dist_checkpointing.storage.read_metadata`, whose
  unpickler builds DCP's metadata classes only;
- ``__R_K.distcp``: the records. Each tensor box is a ``torch.save`` archive
  (``weights_only=True``); byte entries are ``_extra_state`` (``None``), RNG and rerun states,
  and, at Megatron-LM ``d98e8a6``, the common state ``common_state/shard_0_1`` (older versions
  write it to ``common.pt``): a ``torch.save`` of ``[{"args": Namespace, "iteration", ...}]``,
  read through :mod:`.safe_pickle` (Megatron enums become inert stand-ins; nothing runs).

Tensor keys (Megatron-Core ``sharded_state_dict``; local spec or TransformerEngine's names):
transformer parameters are **stacked over global layers**, ``decoder.layers.<suffix> [L, ...]``:

=============================================================  ===========================================
Megatron-LM key (``decoder.layers.`` + suffix)                  ours (global keys, layer n)
=============================================================  ===========================================
``self_attention.linear_qkv.layer_norm_weight`` /               ``layers.n.input_layernorm.weight``
``input_layernorm.weight`` ``[L, h]``
``self_attention.linear_qkv.weight [L, (nh + 2 ng) d, h]``      ``layers.n.self_attention.query/key/value``
(per query group ``[q_g; k_g; v_g]``, :func:`megatron_lm.qkv_to_ours`)
``self_attention.linear_proj.weight [L, h, nh d]``              ``layers.n.self_attention.dense.weight``
``mlp.linear_fc1.layer_norm_weight`` / ``pre_mlp_layernorm``    ``layers.n.post_attention_layernorm.weight``
``mlp.linear_fc1.weight [L, 2f, h]`` (``[gate; up]`` globally)  ``layers.n.mlp.gate`` / ``mlp.up``
``mlp.linear_fc2.weight [L, h, f]``                             ``layers.n.mlp.dense_4h_to_h.weight``
=============================================================  ===========================================

and ``embedding.word_embeddings.weight``, ``decoder.final_layernorm.weight``,
``output_layer.weight`` as in the legacy format. Our model's global tensors
(:mod:`megatron.model.sharded_state`) are then cut for this run's layout exactly as our own
``torch_dist`` load cuts them, so the checkpoint loads at any TP / PP. Each rank reads only the
layers (and embedding / output layer) its stage holds.

Not read: Megatron-LM's optimizer state (``optimizer.*`` keys): such a checkpoint loads its
weights with ``--finetune`` or ``--no-load-optim``; MoE experts saved in this format.
"""

from __future__ import annotations

import json
import os
import re

import torch

from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
from megatron.checkpointing.foreign import megatron_lm
from megatron.core.dist_checkpointing.safe_pickle import load_raw_bytes, load_raw, to_plain

METADATA_JSON, COMMON_FILE, COMMON_RECORD = "metadata.json", "common.pt", "common_state/"
STACKED = "decoder.layers."
# stacked suffix -> our per-layer suffix; fused tensors split in _layer_tensors
_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": None,  # query / key / value
    "self_attention.linear_proj.weight": "self_attention.dense.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": None,  # gate / up
    "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
    "mlp.router.weight": "mlp.router.weight",
}
_TOP = {"embedding.word_embeddings.weight": "word_embeddings.weight",
        "decoder.final_layernorm.weight": "final_layernorm.weight",
        "output_layer.weight": "output_layer.weight"}
# byte entries and states that carry no weights
_NOT_WEIGHTS = re.compile(r"(.*\._extra_state(/.*)?|rng_state/.*|rerun_state_machine_state/.*|"
                          r"common_state/.*)")


def is_megatron_lm(folder: str) -> bool:
    """True when the ``iter_*`` folder holds a ``torch_dist`` checkpoint Megatron-LM wrote (its
    ``metadata.json`` names the torch_dist backend and has no ``format_version``)."""
    try:
        with open(os.path.join(folder, METADATA_JSON), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return (isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist"
            and "format_version" not in meta)


def read_metadata(folder: str):
    """DCP's metadata of ``folder`` (the safe reader; :class:`CheckpointError` naming the file)."""
    from megatron.core.dist_checkpointing import storage

    try:
        return storage.read_metadata(folder)
    except storage.CheckpointFormatError as exc:
        raise CheckpointError(str(exc)) from None


def read_common(folder: str, metadata) -> dict:
    """The common state (``args`` as a plain dict, ``iteration``, ``checkpoint_version``, ...):
    ``common.pt`` when there is one, else the ``common_state`` byte record.

    Raises:
        CheckpointError: neither, or refused / damaged (names the file and record).
    """
    path = os.path.join(folder, COMMON_FILE)
    if os.path.isfile(path):
        common = load_raw(path)
    else:
        record = [(index, info) for index, info in metadata.storage_data.items()
                  if index.fqn.startswith(COMMON_RECORD)]
        if not record:
            raise CheckpointError(f"{folder} holds neither {COMMON_FILE} nor a common_state "
                                  "record: it is not a complete Megatron-LM torch_dist checkpoint")
        index, info = record[0]
        name = f"{os.path.join(folder, str(info.relative_path))} (record {index.fqn})"
        with open(os.path.join(folder, str(info.relative_path)), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CheckpointError(f"{name} is truncated")
        common = load_raw_bytes(data, name)
    if isinstance(common, list) and len(common) == 1:  # Megatron-Core's common byte record
        common = common[0]
    if not isinstance(common, dict) or "args" not in common:
        raise CheckpointError(f"the common state of {folder} holds no args: it is not a "
                              "Megatron-LM training checkpoint")
    common = dict(common)
    common["args"] = to_plain(common["args"])
    return common


def weight_keys(metadata) -> dict:
    """``{Megatron-LM key: (global shape, dtype)}`` of the weights; optimizer keys apart.

    Raises:
        CheckpointError: a tensor this LLaMA has no counterpart for (experts, biases, QK norm).
    """
    from megatron.core.dist_checkpointing.storage import tensor_shapes

    out = {}
    for key, (shape, dtype) in tensor_shapes(metadata).items():
        if key.startswith("optimizer.") or _NOT_WEIGHTS.fullmatch(key):
            continue
        known = key in _TOP or (key.startswith(STACKED) and key[len(STACKED):] in _LAYER)
        if not known:
            raise CheckpointError(f"tensor {key} of the Megatron-LM torch_dist checkpoint has no "
                                  "counterpart in this LLaMA (biases, QK layernorm, shared "
                                  "experts and experts saved in torch_dist are not read)")
        out[key] = (shape, dtype)
    return out


def has_optimizer_state(metadata) -> bool:
    return any(index.fqn.startswith("optimizer.") for index in metadata.storage_data)


def read_weights(folder: str, metadata, layers=None, top=None) -> dict:
    """The Megatron-LM tensors needed, read in this process alone (no collective):
    ``{key: tensor}``, stacked keys holding only the global layers ``layers`` (a range; all when
    None) with a ``"__first_layer__"`` entry; ``top`` the non-layer keys wanted (all when None)."""
    from megatron.core.dist_checkpointing import storage
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    boxes = []
    for key, (shape, dtype) in sorted(weight_keys(metadata).items()):
        if key.startswith(STACKED):
            lo, hi = (0, shape[0]) if layers is None else (layers.start, layers.stop)
            if hi <= lo:
                continue
            boxes.append(ShardedTensor(key, torch.empty((hi - lo, *shape[1:]), dtype=dtype),
                                       tuple(shape), (lo,) + (0,) * (len(shape) - 1)))
        elif top is None or key in top:
            boxes.append(ShardedTensor(key, torch.empty(shape, dtype=dtype), tuple(shape),
                                       (0,) * len(shape)))
    try:
        storage.load(boxes, folder, metadata=metadata, single_process=True)
    except storage.CheckpointFormatError as exc:
        raise CheckpointError(str(exc)) from None
    out = {b.key: b.data for b in boxes}
    out["__first_layer__"] = 0 if layers is None else layers.start
    return out


def to_our_global(tensors: dict, config: dict) -> dict:
    """Our global tensors (:mod:`megatron.model.sharded_state` keys, layer numbers global) from
    :func:`read_weights`' Megatron-LM tensors, with the args ``config`` (:func:`our_args`).

    Raises:
        CheckpointError: a stacked tensor whose shape contradicts the args.
    """
    h, f, d = config["hidden_size"], config["ffn_hidden_size"], config["kv_channels"]
    heads, groups = config["num_attention_heads"], config["num_query_groups"]
    first = tensors["__first_layer__"]
    out = {}
    for key, tensor in tensors.items():
        if key == "__first_layer__":
            continue
        if key in _TOP:
            out[_TOP[key]] = tensor
            continue
        suffix = key[len(STACKED):]
        for i, layer in enumerate(tensor):
            prefix = f"layers.{first + i}."
            if suffix == "self_attention.linear_qkv.weight":
                want = ((heads + 2 * groups) * d, h)
                _check(key, layer, want)
                qkv = megatron_lm.qkv_to_ours(layer, heads, groups, d)
                out[prefix + "self_attention.query.weight"] = qkv[:heads * d]
                out[prefix + "self_attention.key.weight"] = qkv[heads * d:(heads + groups) * d]
                out[prefix + "self_attention.value.weight"] = qkv[(heads + groups) * d:]
            elif suffix == "mlp.linear_fc1.weight":
                _check(key, layer, (2 * f, h))
                out[prefix + "mlp.gate.weight"], out[prefix + "mlp.up.weight"] = layer[:f], layer[f:]
            else:
                out[prefix + _LAYER[suffix]] = layer
    return out


def _check(key: str, layer: torch.Tensor, want: tuple) -> None:
    if tuple(layer.shape) != want:
        raise CheckpointError(f"tensor {key} of the Megatron-LM torch_dist checkpoint has layers "
                              f"of shape {list(layer.shape)}, but its args give {list(want)}: the "
                              "checkpoint contradicts its args")


def our_args(common: dict, folder: str, overrides: dict | None = None, notes=None) -> dict:
    """Our model arguments of the checkpoint (:func:`megatron_lm.our_args` on its ``args``,
    after its ``checkpoint_version``)."""
    version = common.get("checkpoint_version", 3.0)
    if float(version) < 2.0:
        raise CheckpointError(f"{folder} has checkpoint_version {version}; re-save it with a "
                              "current Megatron-LM")
    return megatron_lm.our_args(common["args"], f"the Megatron-LM torch_dist checkpoint {folder}",
                                overrides, notes)


def saved_args(folder: str) -> dict:
    """Our-named model arguments of the checkpoint, for ``--use-checkpoint-args`` and inference
    (values its args lose are left out: the run's flags supply them; ``seq_length`` too)."""
    ours = our_args(read_common(folder, read_metadata(folder)), folder)
    return {k: v for k, v in ours.items() if v is not None and k != "seq_length"}


def whole_model(folder: str, overrides: dict | None = None, notes=None):
    """``(our args, our global tensors)`` of the whole checkpoint, read in this process (tools)."""
    metadata = read_metadata(folder)
    common = read_common(folder, metadata)
    ours = our_args(common, folder, overrides, notes)
    if ours.get("num_experts"):
        raise CheckpointError(f"{folder} is a Megatron-LM MoE checkpoint in torch_dist; its "
                              "experts are not read in this format: convert it with Megatron-LM "
                              "(--ckpt-convert-format torch) and read that")
    return ours, to_our_global(read_weights(folder, metadata), ours)


def load_into(folder: str, model_chunks, optimizer, config, pg_collection, run_flags: dict) -> dict:
    """``--load`` of a Megatron-LM torch_dist checkpoint into this rank's model chunks, at this
    run's layout (weights only: iteration 0, the optimizer's main parameters refreshed).

    Every rank reads the Megatron-LM boxes of its own layers (and the embedding / output layer
    where its stage has them), maps them to our global tensors and copies its boxes of our
    model's shardings out of them; failures are agreed over the world (one line, every rank).

    Raises:
        CheckpointError / UsageError: refused (another model than the flags, optimizer state
            without ``--finetune`` or ``--no-load-optim``, a tensor not read), or damaged files.
    """
    import torch.distributed as dist

    from megatron.checkpointing.checkpoint_folder import agree_on_load_error
    from megatron.checkpointing.foreign import check_run_matches
    from megatron.model import unwrap_model
    from megatron.model.sharded_state import model_sharded_tensors

    device = next(unwrap_model(model_chunks[0]).parameters()).device
    notes, error = [], None
    try:
        metadata = read_metadata(folder)
        common = read_common(folder, metadata)
        overrides = {k: run_flags.get(k) for k in ("norm_epsilon", "rotary_base",
                                                   "max_position_embeddings")}
        ours = our_args(common, folder, overrides, notes)
        source = f"--load {config.load} (a Megatron-LM torch_dist checkpoint)"
        check_run_matches(ours, run_flags, source)
        if ours.get("num_experts"):
            raise CheckpointError(f"{source} is a MoE model; its experts are not read in "
                                  "torch_dist: convert it with Megatron-LM to --ckpt-format torch")
        if has_optimizer_state(metadata) and not config.finetune and not config.no_load_optim:
            raise CheckpointError(f"{source} holds Megatron-LM optimizer state, which is not "
                                  "read; pass --finetune (or --no-load-optim) to load the weights")
        boxes = model_sharded_tensors(model_chunks, pg_collection, prefix="")
        numbers = sorted({int(b.key.split(".")[1]) for b in boxes if b.key.startswith("layers.")})
        layers = range(numbers[0], numbers[-1] + 1) if numbers else range(0)
        top = {k for k, v in _TOP.items() if any(b.key == v for b in boxes)}
        tensors = to_our_global(read_weights(folder, metadata, layers, top), ours)
        with torch.no_grad():
            for box in boxes:
                _fill(box, tensors, source)
    except Exception as exc:  # noqa: BLE001 - agreed below, re-raised on every rank
        error = exc
    agree_on_load_error(error, device, folder)
    if optimizer is not None:
        optimizer.reload_model_params()
    if dist.get_rank() == 0:
        print(f" loaded the Megatron-LM torch_dist checkpoint {folder} (saved at TP="
              f"{ours['tensor_model_parallel_size']}, PP={ours['pipeline_model_parallel_size']}) "
              "into this run's layout: weights only, training starts at iteration 0", flush=True)
        for note in notes:
            print(f" {note}", flush=True)
    return {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}


def _fill(box, tensors: dict, source: str) -> None:
    """Copy one of our boxes out of the global tensor of its key (a padded vocabulary: the rows
    both have; further rows keep their values)."""
    whole = tensors.get(box.key)
    if whole is None:
        raise CheckpointError(f"{source} has no tensor for {box.key}")
    if box.resizable and whole.shape[0] != box.global_shape[0]:
        box = box.clipped_rows(whole.shape[0])
        if box is None:
            return
    if tuple(whole.shape) != tuple(box.global_shape):
        raise CheckpointError(f"{source}: {box.key} has global shape {list(whole.shape)}, this "
                              f"run's model {list(box.global_shape)}")
    part = whole
    for dim, (start, length) in enumerate(zip(box.global_offset, box.data.shape)):
        part = part.narrow(dim, start, length)
    box.data.copy_(part)
