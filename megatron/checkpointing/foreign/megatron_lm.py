"""The one mapping of NVIDIA Megatron-LM's LLaMA checkpoints (``--ckpt-format torch``) onto ours:
tensor names, the fused-QKV order and the model arguments. ``megatron.checkpointing`` uses it to
``--load`` such a checkpoint directly, ``tools/checkpoint/loader_megatron.py`` to convert one.

Names (per tensor-parallel rank; layer numbers are local to the pipeline stage, as ours):

============================================  =================================================  =====================================
Megatron-Core (``decoder.``)                  legacy model (``language_model.``, nested dicts)    ours
============================================  =================================================  =====================================
``embedding.word_embeddings.weight``          ``language_model.embedding.word_embeddings.weight``  ``word_embeddings.weight``
``decoder.layers.N.input_layernorm``          ``...encoder.layers.N.input_norm``                  ``layers.N.input_layernorm``
``...self_attention.linear_qkv``              ``...self_attention.query_key_value``               ``...self_attention.query_key_value``
``...self_attention.linear_proj``             ``...self_attention.dense``                         ``...self_attention.dense``
``...pre_mlp_layernorm``                      ``...post_attention_norm``                          ``...post_attention_layernorm``
``...mlp.linear_fc1`` (``[gate_r; up_r]``)    ``...mlp.dense_h_to_4h``                            ``...mlp.dense_h_to_4h``
``...mlp.linear_fc2``                         ``...mlp.dense_4h_to_h``                            ``...mlp.dense_4h_to_h``
``decoder.final_layernorm``                   ``...encoder.final_norm``                           ``final_layernorm``
``output_layer``                              ``language_model.output_layer``                     ``output_layer``
============================================  =================================================  =====================================

(the legacy model's older ``input_layernorm`` / ``post_attention_layernorm`` / ``final_layernorm``
spellings, and TransformerEngine's norms fused into the next linear,
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``, map the same way;
``_extra_state`` entries carry no weights and are dropped.)

Fused QKV: Megatron-LM orders each rank's rows per query group, ``[q heads of group g; k_g;
v_g]`` for its groups in turn (Megatron-Core ``SelfAttention.get_query_key_value_tensors``); ours
is ``[Q of the rank; K of the rank; V of the rank]``. Both give rank r the same consecutive heads
and groups, so the reordering is local to each shard (:func:`qkv_to_ours`).
"""

from __future__ import annotations

import torch

from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
from megatron.core.dist_checkpointing.safe_pickle import flatten

QKV = "self_attention.query_key_value.weight"
_LAYER = {  # per-layer suffix -> ours
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_norm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": QKV,
    QKV: QKV,
    "self_attention.linear_proj.weight": "self_attention.dense.weight",
    "self_attention.dense.weight": "self_attention.dense.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight",
    "mlp.dense_h_to_4h.weight": "mlp.dense_h_to_4h.weight",
    "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
    "mlp.dense_4h_to_h.weight": "mlp.dense_4h_to_h.weight",
}
_LAYER_PREFIXES = ("decoder.layers.", "language_model.encoder.layers.")
_TOP = {
    "embedding.word_embeddings.weight": "word_embeddings.weight",
    "language_model.embedding.word_embeddings.weight": "word_embeddings.weight",
    "decoder.final_layernorm.weight": "final_layernorm.weight",
    "language_model.encoder.final_norm.weight": "final_layernorm.weight",
    "language_model.encoder.final_layernorm.weight": "final_layernorm.weight",
    "output_layer.weight": "output_layer.weight",
    "language_model.output_layer.weight": "output_layer.weight",
    "word_embeddings_for_head.weight": "word_embeddings_for_head.weight",  # legacy, tied, PP > 1
}


def naming(model_state: dict) -> str | None:
    """``"core"`` (``decoder.layers...``), ``"legacy"`` (``language_model.encoder...``) or None
    for a flat or nested model state dict of a Megatron-LM shard."""
    keys = flatten(model_state)
    if any(k.startswith(("decoder.", "embedding.word_embeddings")) for k in keys):
        return "core"
    if any(k.startswith("language_model.") for k in keys):
        return "legacy"
    return None


def model_keys(state: dict) -> list:
    """``["model"]``, or ``["model0", "model1", ...]`` with virtual pipeline stages."""
    chunks = sorted((k for k in state if k[:5] == "model" and k[5:].isdigit()), key=lambda k: int(k[5:]))
    return ["model"] if "model" in state or not chunks else chunks


def top_tensor(model_state: dict, ours: str) -> torch.Tensor:
    """The tensor of a shard that maps to our non-layer name ``ours`` (``word_embeddings.weight``).

    Raises:
        CheckpointError: the shard has none (not a first / last pipeline stage).
    """
    for name, tensor in flatten(model_state).items():
        if _TOP.get(name) == ours:
            return tensor
    raise CheckpointError(f"the Megatron-LM shard holds no tensor for {ours}")


def qkv_to_ours(weight: torch.Tensor, heads: int, groups: int, kv_channels: int) -> torch.Tensor:
    """One rank's fused QKV from Megatron-LM's per-group order to ours.

    Args:
        weight: ``[(heads + 2 groups) * d, h]``: ``groups`` blocks of ``[q of the group's
            heads/groups heads; k; v]``, each ``kv_channels`` = d rows per head.
        heads, groups: the query heads and key/value groups *of this rank*.

    Returns:
        ``[heads*d (q); groups*d (k); groups*d (v), h]``, head order unchanged (a new tensor).
    """
    d, per = kv_channels, heads // groups
    if weight.shape[0] != (heads + 2 * groups) * d:
        raise CheckpointError(f"fused QKV weight of {weight.shape[0]} rows does not hold {heads} "
                              f"query heads and {groups} key/value groups of {d} channels")
    w = weight.reshape(groups, (per + 2) * d, *weight.shape[1:])
    q, k, v = w[:, :per * d], w[:, per * d:(per + 1) * d], w[:, (per + 1) * d:]
    return torch.cat([t.reshape(-1, *weight.shape[1:]) for t in (q, k, v)], 0)


def expected_shape(ours: str, config: dict, tp: int) -> tuple:
    """The shape one tensor-parallel rank's tensor ``ours`` has by the checkpoint's own args
    (Megatron-LM's per-rank shapes, fused QKV and ``[gate; up]`` included); None for a
    dimension the args do not fix (the padded vocabulary)."""
    h, f, d = config["hidden_size"], config["ffn_hidden_size"], config["kv_channels"]
    heads, groups = config["num_attention_heads"] // tp, config["num_query_groups"] // tp
    suffix = ours.split(".", 2)[2] if ours.startswith("layers.") else ours
    return {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "final_layernorm.weight": (h,), QKV: ((heads + 2 * groups) * d, h),
            "self_attention.dense.weight": (h, heads * d),
            "mlp.dense_h_to_4h.weight": (2 * (f // tp), h), "mlp.dense_4h_to_h.weight": (h, f // tp),
            }.get(suffix, (None, h))  # embeddings and output layer: [vocab / TP, h]


def _check_shape(name: str, ours: str, tensor: torch.Tensor, config: dict, tp: int) -> None:
    want = expected_shape(ours, config, tp)
    have = tuple(tensor.shape)
    if len(have) != len(want) or any(w is not None and w != g for w, g in zip(want, have)):
        shown = [("vocab/TP" if w is None else w) for w in want]
        raise CheckpointError(
            f"tensor {name} of the Megatron-LM checkpoint has shape {list(have)}, but its own "
            f"args (hidden_size {config['hidden_size']}, ffn_hidden_size "
            f"{config['ffn_hidden_size']}, {config['num_attention_heads']} heads in "
            f"{config['num_query_groups']} groups of {config['kv_channels']} channels, TP {tp}) "
            f"give {shown}: the checkpoint contradicts its args (damaged, or args edited)")


def to_our_state_dict(model_state: dict, config: dict, tp: int) -> dict:
    """One rank's Megatron-LM model state dict (flat or nested) with our names and QKV layout.

    Args:
        config: our-named model arguments (:func:`our_args`): heads, groups, kv_channels, tie.
        tp: the tensor-parallel size the checkpoint was written at.

    Raises:
        CheckpointError: a tensor this model does not have (biases, QK-norm, experts), or whose
            shape contradicts the args (:func:`expected_shape`), named.
    """
    heads, groups = config["num_attention_heads"] // tp, config["num_query_groups"] // tp
    out = {}
    for name, tensor in flatten(model_state).items():
        if name.endswith("_extra_state"):
            continue
        ours = _TOP.get(name)
        prefix = next((p for p in _LAYER_PREFIXES if name.startswith(p)), None)
        if ours is None and prefix is not None:
            number, _, suffix = name[len(prefix):].partition(".")
            ours = f"layers.{number}.{_LAYER[suffix]}" if suffix in _LAYER else None
        if ours is None:
            raise CheckpointError(f"tensor {name} of the Megatron-LM checkpoint has no "
                                  "counterpart in this LLaMA (biases, QK layernorm and experts "
                                  "are not implemented)")
        _check_shape(name, ours, tensor, config, tp)
        if ours.endswith(QKV):
            tensor = qkv_to_ours(tensor, heads, groups, config["kv_channels"])
        if ours == "output_layer.weight" and not config["untie_embeddings_and_output_weights"]:
            ours = "word_embeddings_for_head.weight"  # Megatron-Core's tied last-stage copy
        out[ours] = tensor
    return out


# field: (value our LLaMA implements, what that is, the value an older Megatron-LM meant when the
# field was not recorded yet)
_REQUIRED = {
    "normalization": ("RMSNorm", "RMSNorm", "LayerNorm"),
    "swiglu": (True, "SwiGLU", False),
    "add_bias_linear": (False, "no linear biases", True),
    "add_qkv_bias": (False, "no QKV bias", False),
    "position_embedding_type": ("rope", "rotary position embeddings", "learned_absolute"),
    "rotary_interleaved": (False, "half-rotation (non-interleaved) RoPE", False),
    "rotary_percent": (1.0, "RoPE on every channel", 1.0),
    "qk_layernorm": (False, "no QK layernorm", False),
    "apply_layernorm_1p": (False, "plain RMSNorm weights", False),
    "layernorm_zero_centered_gamma": (False, "plain RMSNorm weights", False),
    "num_experts": (None, "a dense MLP", None),
    "multi_latent_attention": (False, "standard attention", False),
}


def check_architecture(saved: dict, source: str) -> None:
    """Refuse a Megatron-LM model this LLaMA does not implement.

    Raises:
        CheckpointError: naming the first field that differs and its value.
    """
    for field, (want, meaning, if_absent) in _REQUIRED.items():
        have = saved.get(field, if_absent)
        if field == "position_embedding_type" and field not in saved and saved.get(
                "use_rotary_position_embeddings"):
            have = "rope"
        if have != want:
            raise CheckpointError(f"{source} has {field}={have!r}; this LLaMA implements only "
                                  f"{meaning} ({field}={want!r})")


def setting(saved: dict, fields, flag: str, given, source: str, notes: list):
    """A model value: the flag ``flag`` when ``given`` (it overrides, noted in ``notes``), else the
    first of ``fields`` the checkpoint's args record.

    Raises:
        CheckpointError: neither (names the missing field and the flag that supplies it).
    """
    recorded = next((saved[f] for f in fields if saved.get(f) is not None), None)
    if given is not None:
        if recorded is not None and recorded != given:
            notes.append(f"{flag} {given} overrides {fields[0]}={recorded} of {source}")
        return given
    if recorded is None:
        raise CheckpointError(f"{source} does not record {' or '.join(fields)}; pass {flag} with "
                              "the value the model was trained with")
    return recorded


def our_args(saved: dict, source: str, overrides: dict | None = None, notes: list | None = None) -> dict:
    """Our model arguments (``ModelConfig`` / ``args`` names) from a Megatron-LM ``args`` dict.

    ``overrides`` holds the flags that supply what Megatron-LM's args lose or may hold wrongly:
    ``norm_epsilon`` (``--norm-epsilon``), ``rotary_base`` (``--rotary-base``),
    ``max_position_embeddings`` (``--max-position-embeddings``, Megatron-LM's HF loader
    hard-codes 4096), ``true_vocab_size``.

    Raises:
        CheckpointError: an architecture this LLaMA does not implement, or a missing value,
            naming the field (and the flag).
    """
    overrides, notes = overrides or {}, notes if notes is not None else []
    missing = [k for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
               if saved.get(k) is None]
    if missing:
        raise CheckpointError(f"{source}: its args do not record {', '.join(missing)}; it is not "
                              "a Megatron-LM training or converter checkpoint")
    check_architecture(saved, source)
    heads = saved["num_attention_heads"]
    groups = saved.get("num_query_groups") if saved.get("group_query_attention") else heads
    out = {
        "num_layers": saved["num_layers"], "hidden_size": saved["hidden_size"],
        "ffn_hidden_size": saved["ffn_hidden_size"], "num_attention_heads": heads,
        "num_query_groups": groups, "group_query_attention": groups != heads,
        "kv_channels": saved.get("kv_channels") or saved["hidden_size"] // heads,
        "untie_embeddings_and_output_weights": bool(saved.get("untie_embeddings_and_output_weights")),
        "norm_epsilon": setting(saved, ("norm_epsilon", "layernorm_epsilon"), "--norm-epsilon",
                                overrides.get("norm_epsilon"), source, notes),
        "rotary_base": float(setting(saved, ("rotary_base",), "--rotary-base",
                                     overrides.get("rotary_base"), source, notes)),
        "max_position_embeddings": setting(saved, ("max_position_embeddings",),
                                           "--max-position-embeddings",
                                           overrides.get("max_position_embeddings"), source, notes),
        "seq_length": saved.get("seq_length"), "padded_vocab_size": saved.get("padded_vocab_size"),
        "make_vocab_size_divisible_by": saved.get("make_vocab_size_divisible_by"),
        "true_vocab_size": overrides.get("true_vocab_size") or saved.get("vocab_size"),
        "tensor_model_parallel_size": saved.get("tensor_model_parallel_size", 1),
        "pipeline_model_parallel_size": saved.get("pipeline_model_parallel_size", 1),
        "virtual_pipeline_model_parallel_size": saved.get("virtual_pipeline_model_parallel_size"),
        "tokenizer_type": saved.get("tokenizer_type"), "tokenizer_model": saved.get("tokenizer_model"),
        "params_dtype": {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(
            str(saved.get("params_dtype")), "fp32"),
        "rope_scaling": None, "use_rope_scaling": bool(saved.get("use_rope_scaling")),
    }
    if out["use_rope_scaling"]:  # Megatron-Core's _apply_scaling: only the factor is a flag
        out["rope_scaling"] = {"rope_type": "llama3", "factor": float(saved["rope_scaling_factor"]),
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}
        out.update(rope_scaling_factor=out["rope_scaling"]["factor"],
                   rope_scaling_low_freq_factor=1.0, rope_scaling_high_freq_factor=4.0,
                   rope_scaling_original_max_position_embeddings=8192)
    return out
