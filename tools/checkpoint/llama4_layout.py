"""Llama 4's text model (transformers' ``Llama4ForCausalLM``, ``model_type: llama4_text``) in
the converters: its ``config.json`` onto our flags' fields, and its layer tensors onto the
logical ones of :mod:`tools.checkpoint.layout` / :mod:`tools.checkpoint.moe_layout` and back.

Hub layout per layer ``model.layers.{i}.``: ``self_attn.{q,k,v,o}_proj.weight``,
``input_layernorm`` / ``post_attention_layernorm``; a MoE layer (``moe_layers``) holds
``feed_forward.router.weight [E, h]``, ``feed_forward.experts.gate_up_proj [E, h, 2f]`` (the
transpose of our ``[gate; up]`` rows), ``feed_forward.experts.down_proj [E, f, h]`` and the
shared expert ``feed_forward.shared_expert.{gate,up,down}_proj.weight`` (width f, no gate); a
dense layer holds ``feed_forward.{gate,up,down}_proj.weight`` of width
``intermediate_size_mlp``. RoPE is on interleaved pairs (``--rotary-interleaved``), so the q/k
rows are taken as they are (no permutation as for Llama 2/3's Hub files).
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from tools.checkpoint.moe_layout import ExpertError

MODEL_TYPE = "llama4_text"
# config.json fields read here (beside loader_hf's common ones)
FIELDS = {"intermediate_size_mlp", "num_local_experts", "num_experts_per_tok", "moe_layers",
          "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers", "no_rope_layer_interval",
          "attention_chunk_size", "layer_types", "attn_temperature_tuning", "floor_scale",
          "attn_scale", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise"}
REQUIRED = {"router_jitter_noise": (0.0, 0, None)}

_DENSE = {"gate": "feed_forward.gate_proj.weight", "up": "feed_forward.up_proj.weight",
          "down": "feed_forward.down_proj.weight"}
_SHARED = {"shared_gate": "feed_forward.shared_expert.gate_proj.weight",
           "shared_up": "feed_forward.shared_expert.up_proj.weight",
           "shared_down": "feed_forward.shared_expert.down_proj.weight"}


def moe_layers(cfg: dict) -> list:
    """0-based MoE layer indices of ``cfg`` (transformers' rule: ``moe_layers``, else every
    ``interleave_moe_layer_step``-th layer ending each step)."""
    if cfg.get("moe_layers") is not None:
        return list(cfg["moe_layers"])
    step = cfg.get("interleave_moe_layer_step", 1)
    return list(range(step - 1, cfg["num_hidden_layers"], step))


def meta_from_config(cfg: dict, path: str) -> dict:
    """The Llama-4-only fields of the metadata (``ModelConfig`` / ``MoEConfig`` names).

    Raises:
        ValueError: layer types that disagree with the RoPE pattern (naming the file).
    """
    n = cfg["num_hidden_layers"]
    step = cfg.get("no_rope_layer_interval", 4)
    rope = cfg.get("no_rope_layers") or [int((i + 1) % step != 0) for i in range(n)]
    chunk = cfg.get("attention_chunk_size")
    types = cfg.get("layer_types")
    if types is not None:
        expected = ["chunked_attention" if r and chunk is not None else "full_attention"
                    for r in rope]
        if list(types) != expected:
            raise ValueError(f"{path}: layer_types {types!r} differ from the chunked RoPE / full "
                             f"NoPE layers of no_rope_layers {rope!r}; other mixes are not "
                             "supported")
    moe = set(moe_layers(cfg))
    return {
        "ffn_hidden_size": cfg.get("intermediate_size_mlp") or cfg["intermediate_size"],
        "num_experts": cfg["num_local_experts"], "moe_router_topk": cfg["num_experts_per_tok"],
        "moe_ffn_hidden_size": cfg["intermediate_size"],
        "moe_shared_expert_intermediate_size": cfg["intermediate_size"],
        "moe_router_score_function": "sigmoid", "moe_apply_probs_on_input": True,
        # Llama4ForCausalLM's loss has no router term (its router_aux_loss_coef is unused)
        "moe_aux_loss_coeff": 0.0,
        "moe_layer_freq": tuple(int(i in moe) for i in range(n)),
        "no_rope_freq": tuple(1 - int(r) for r in rope),
        "attention_chunk_size": chunk, "qk_l2_norm": bool(cfg.get("use_qk_norm", True)),
        "attn_temperature_tuning": bool(cfg.get("attn_temperature_tuning", True)),
        "attn_temperature_floor_scale": float(cfg.get("floor_scale", 8192)),
        "attn_temperature_scale": float(cfg.get("attn_scale", 0.1)),
        "rotary_interleaved": True, "hf_architecture": MODEL_TYPE,
    }


def read_mlp(i: int, meta: dict, get: Callable[[str], torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The logical MLP tensors of layer ``i``: ``router``, ``experts_*`` and ``shared_*`` of a
    MoE layer, ``gate``/``up``/``down`` of a dense one.

    Raises:
        ExpertError: fused experts of the wrong shape (naming the layer).
    """
    prefix = f"model.layers.{i}."
    if not meta["moe_layer_freq"][i]:
        return {k: get(prefix + v) for k, v in _DENSE.items()}
    E, f, h = meta["num_experts"], meta["moe_ffn_hidden_size"], meta["hidden_size"]
    gate_up = get(prefix + "feed_forward.experts.gate_up_proj")
    down = get(prefix + "feed_forward.experts.down_proj")
    if tuple(gate_up.shape) != (E, h, 2 * f) or tuple(down.shape) != (E, f, h):
        raise ExpertError(f"layer {i}: experts have shapes {tuple(gate_up.shape)} / "
                          f"{tuple(down.shape)}, expected ({E}, {h}, {2 * f}) / ({E}, {f}, {h})")
    gate_up = gate_up.transpose(1, 2)
    out = {"router": get(prefix + "feed_forward.router.weight"),
           "experts_gate": gate_up[:, :f].contiguous(), "experts_up": gate_up[:, f:].contiguous(),
           "experts_down": down.transpose(1, 2).contiguous()}
    out.update({k: get(prefix + v) for k, v in _SHARED.items()})
    return out


def write_mlp(i: int, layer: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`read_mlp`: the Hub tensors of layer ``i``'s MLP."""
    prefix = f"model.layers.{i}."
    if "router" not in layer:
        return {prefix + v: layer[k] for k, v in _DENSE.items()}
    gate_up = torch.cat([layer["experts_gate"], layer["experts_up"]], 1).transpose(1, 2)
    out = {prefix + "feed_forward.router.weight": layer["router"],
           prefix + "feed_forward.experts.gate_up_proj": gate_up.contiguous(),
           prefix + "feed_forward.experts.down_proj":
               layer["experts_down"].transpose(1, 2).contiguous()}
    out.update({prefix + v: layer[k] for k, v in _SHARED.items()})
    return out


def is_llama4(saved: dict) -> bool:
    """Whether recorded args are Llama 4's: converted from it, or trained with its router
    (``--moe-apply-probs-on-input``, which only Llama 4 among the exported families has)."""
    return saved.get("hf_architecture") == MODEL_TYPE or bool(saved.get("moe_apply_probs_on_input"))


def meta_from_args(saved: dict, expert_parallel: bool = False) -> dict:
    """The Llama-4-only metadata of a checkpoint's recorded ``saved`` args (per-layer patterns
    as tuples); an expert-parallel size > 1 only where the caller joins the experts
    (``expert_parallel``: our own shards).

    Raises:
        CheckpointError: MoE settings Llama 4 does not have (naming the setting).
    """
    from megatron.checkpointing import CheckpointError
    n = saved["num_layers"]
    freq = saved.get("moe_layer_freq", 1)
    pattern = tuple(freq) if isinstance(freq, (list, tuple)) else tuple(
        int(i % freq == 0) for i in range(n))
    checked = (("moe_router_score_function", "sigmoid"), ("moe_apply_probs_on_input", True),
               ("moe_router_topk", 1))
    for key, want in checked + ((("expert_model_parallel_size", 1),) if not expert_parallel
                                else ()):
        if saved.get(key, want) != want:
            raise CheckpointError(f"--{key.replace('_', '-')} {saved[key]!r} in the checkpoint's "
                                  f"args is not Llama 4's ({want!r}); not converted")
    no_rope = saved.get("no_rope_freq")
    return {"moe_layer_freq": pattern,
            "no_rope_freq": tuple(no_rope) if no_rope is not None else (0,) * n,
            "moe_ffn_hidden_size": saved.get("moe_ffn_hidden_size") or saved["ffn_hidden_size"]}


def _int_if_whole(x):
    """transformers types ``floor_scale`` as an int (tokens)."""
    return int(x) if float(x).is_integer() else x


def hf_config(meta: dict) -> dict:
    """The Llama-4-only ``config.json`` fields of ``meta`` (the inverse of
    :func:`meta_from_config`)."""
    n = meta["num_layers"]
    return {
        "model_type": MODEL_TYPE, "architectures": ["Llama4ForCausalLM"],
        "intermediate_size": meta["moe_ffn_hidden_size"],
        "intermediate_size_mlp": meta["ffn_hidden_size"],
        "num_local_experts": meta["num_experts"], "num_experts_per_tok": meta["moe_router_topk"],
        "moe_layers": [i for i in range(n) if meta["moe_layer_freq"][i]],
        "no_rope_layers": [1 - int(v) for v in (meta.get("no_rope_freq") or (0,) * n)],
        "attention_chunk_size": meta.get("attention_chunk_size"),
        "use_qk_norm": bool(meta.get("qk_l2_norm")),
        "attn_temperature_tuning": bool(meta.get("attn_temperature_tuning")),
        "floor_scale": _int_if_whole(meta.get("attn_temperature_floor_scale", 8192.0)),
        "attn_scale": meta.get("attn_temperature_scale", 0.1),
        "router_aux_loss_coef": 0.0, "router_jitter_noise": 0.0,
    }
