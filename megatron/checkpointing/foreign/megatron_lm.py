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

Mixture-of-experts layers (Megatron-Core's ``SequentialMLP``, what its converter and the local
spec write; expert-tensor-parallel size 1): ``mlp.router.weight [E, h]`` is ours;
``mlp.experts.local_experts.{i}.linear_fc1.weight [2f, h]`` (``[gate; up]``) and ``linear_fc2
[h, f]`` of local expert i are row i of our ``mlp.experts.weight1 [E_local, 2f, h]`` /
``weight2 [E_local, h, f]``. A shard holds the ``E / EP`` experts of its expert-parallel rank
e (global experts ``e * E_local ...``), in the folder ``mp_rank_TT[_PPP]_EEE``, and the dense
tensors replicated.

Fused QKV: Megatron-LM orders each rank's rows per query group, ``[q heads of group g; k_g;
v_g]`` for its groups in turn (Megatron-Core ``SelfAttention.get_query_key_value_tensors``); ours
is ``[Q of the rank; K of the rank; V of the rank]``. Both give rank r the same consecutive heads
and groups, so the reordering is local to each shard (:func:`qkv_to_ours`).
"""

from __future__ import annotations

import re

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
_LAYER["mlp.router.weight"] = "mlp.router.weight"
# SequentialMLP's local expert i: (part of our grouped tensor)
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")
EXPERT_WEIGHTS = {"1": "mlp.experts.weight1", "2": "mlp.experts.weight2"}
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
            "mlp.router.weight": (config.get("num_experts"), h),
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
    """One rank's Megatron-LM model state dict (flat or nested) with our names and QKV layout;
    a MoE layer's local experts stacked into our grouped ``mlp.experts.weight1/2``.

    Args:
        config: our-named model arguments (:func:`our_args`): heads, groups, kv_channels, tie,
            and for MoE ``num_experts``, ``moe_ffn_hidden_size``, ``expert_model_parallel_size``.
        tp: the tensor-parallel size the checkpoint was written at.

    Raises:
        CheckpointError: a tensor this model does not have (biases, QK-norm, TransformerEngine's
            grouped experts), whose shape contradicts the args (:func:`expected_shape`), or a
            layer whose local experts are not exactly ``E / EP``, named.
    """
    heads, groups = config["num_attention_heads"] // tp, config["num_query_groups"] // tp
    out, experts = {}, {}
    for name, tensor in flatten(model_state).items():
        if name.endswith("_extra_state"):
            continue
        ours = _TOP.get(name)
        prefix = next((p for p in _LAYER_PREFIXES if name.startswith(p)), None)
        if ours is None and prefix is not None:
            number, _, suffix = name[len(prefix):].partition(".")
            expert = _LOCAL_EXPERT.fullmatch(suffix)
            if expert is not None and config.get("num_experts"):
                _check_expert_shape(name, tensor, expert.group(2), config)
                key = f"layers.{number}.{EXPERT_WEIGHTS[expert.group(2)]}"
                experts.setdefault(key, {})[int(expert.group(1))] = tensor
                continue
            ours = f"layers.{number}.{_LAYER[suffix]}" if suffix in _LAYER else None
        if ours is None:
            raise CheckpointError(f"tensor {name} of the Megatron-LM checkpoint has no "
                                  "counterpart in this LLaMA (biases, shared experts, "
                                  "TransformerEngine's grouped experts are not read)")
        _check_shape(name, ours, tensor, config, tp)
        if ours.endswith(QKV):
            tensor = qkv_to_ours(tensor, heads, groups, config["kv_channels"])
        if ours == "output_layer.weight" and not config["untie_embeddings_and_output_weights"]:
            ours = "word_embeddings_for_head.weight"  # Megatron-Core's tied last-stage copy
        out[ours] = tensor
    local = (config.get("num_experts") or 0) // config.get("expert_model_parallel_size", 1)
    for key, found in sorted(experts.items()):
        if sorted(found) != list(range(local)):
            raise CheckpointError(
                f"{key}: the Megatron-LM shard holds local experts {sorted(found)}, but its args "
                f"({config['num_experts']} experts over expert-parallel size "
                f"{config.get('expert_model_parallel_size', 1)}) give {local} per shard "
                f"(0..{local - 1}): the shard is incomplete or its args were edited")
        out[key] = torch.stack([found[i] for i in range(local)])
    return out


def _check_expert_shape(name: str, tensor: torch.Tensor, which: str, config: dict) -> None:
    h, f = config["hidden_size"], config["moe_ffn_hidden_size"]
    want = (2 * f, h) if which == "1" else (h, f)
    if tuple(tensor.shape) != want:
        raise CheckpointError(f"tensor {name} of the Megatron-LM checkpoint has shape "
                              f"{list(tensor.shape)}, but its args (hidden_size {h}, "
                              f"moe_ffn_hidden_size {f}) give {list(want)}: the checkpoint "
                              "contradicts its args")


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


# Megatron-LM's MoE args carried as they are (Megatron-Core's dests are our flags' dests)
MOE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
              "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
              "moe_router_group_topk", "moe_router_enable_expert_bias",
              "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
              "moe_router_dtype", "moe_expert_capacity_factor", "moe_token_drop_policy",
              "moe_pad_expert_input_to_capacity")


def moe_args(saved: dict, source: str) -> dict:
    """Our MoE arguments of a Megatron-LM ``args`` dict (empty for a dense model): the
    :data:`MOE_FIELDS` as recorded, ``expert_model_parallel_size`` and
    ``expert_tensor_parallel_size`` 1.

    Raises:
        CheckpointError: MoE settings whose tensors are not read here (a shared expert, dense
            layers between MoE ones, experts split over tensor ranks), naming the field.
    """
    if not saved.get("num_experts"):
        return {}
    freq = saved.get("moe_layer_freq", 1)
    refused = [(f, v) for f, v, ok in (
        ("moe_shared_expert_intermediate_size", saved.get("moe_shared_expert_intermediate_size"),
         saved.get("moe_shared_expert_intermediate_size") is None),
        ("moe_layer_freq", freq, freq == 1 or (isinstance(freq, (list, tuple)) and set(freq) == {1})),
        ("expert_tensor_parallel_size", saved.get("expert_tensor_parallel_size"),
         saved.get("expert_tensor_parallel_size") in (None, 1))) if not ok]
    if refused:
        field, value = refused[0]
        raise CheckpointError(f"{source} has {field}={value!r}; Megatron-LM MoE checkpoints are "
                              "read with every layer MoE, no shared expert and "
                              "expert_tensor_parallel_size 1")
    out = {k: saved.get(k) for k in MOE_FIELDS if k in saved}
    out["moe_ffn_hidden_size"] = saved.get("moe_ffn_hidden_size") or saved["ffn_hidden_size"]
    out.update(moe_layer_freq=1, expert_tensor_parallel_size=1,
               expert_model_parallel_size=saved.get("expert_model_parallel_size") or 1)
    return out


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
        **moe_args(saved, source),
    }
    if out["use_rope_scaling"]:  # Megatron-Core's _apply_scaling: only the factor is a flag
        out["rope_scaling"] = {"rope_type": "llama3", "factor": float(saved["rope_scaling_factor"]),
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}
        out.update(rope_scaling_factor=out["rope_scaling"]["factor"],
                   rope_scaling_low_freq_factor=1.0, rope_scaling_high_freq_factor=4.0,
                   rope_scaling_original_max_position_embeddings=8192)
    return out
