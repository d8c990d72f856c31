"""Loader ``--loader hf``: a HuggingFace LLaMA folder (``config.json``, ``*.safetensors`` or
``pytorch_model*.bin``, tokenizer files), streamed tensor by tensor.

Safetensors are read lazily through ``safetensors.safe_open``; ``.bin`` files with
``torch.load(weights_only=True, mmap=True)`` after a CRC check (:mod:`megatron.core.dist_checkpointing.checkpoint_io`).
A folder asking to run its own code (``auto_map``, ``*.py``) is refused, as are index entries
pointing outside the folder (:mod:`megatron.hf_folder`). Config fields we do not implement are refused
(:func:`meta_from_hf_config`), never dropped.
"""

from __future__ import annotations

import json
import os
import re

import torch

from megatron.hf_folder import open_safetensors, refuse_custom_code, weight_map
from megatron.model.rotary import check_rope_scaling
from tools.checkpoint import llama4_layout, moe_layout
from tools.checkpoint.layout import DTYPES, find_file, load_torch_file

# config.json fields that do not change the math (bookkeeping, generation defaults, dtypes).
_HARMLESS = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "pretraining_tp", "id2label", "label2id", "return_dict", "output_attentions",
    "output_hidden_states", "problem_type", "is_encoder_decoder", "chunk_size_feed_forward",
    "tokenizer_class", "attention_dropout", "max_length", "min_length", "do_sample",
    "temperature", "top_k", "top_p", "quantization_config_none",
}
# fields we implement (read below)
_IMPLEMENTED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings", "hidden_act", "attention_bias",
    "mlp_bias",
}
# implemented only at these values
_REQUIRED_VALUES = {"hidden_act": ("silu",), "attention_bias": (False, None), "mlp_bias": (False, None)}
# Mixtral (MixtralForCausalLM): routed experts; the router's training-only settings are harmless
_MIXTRAL = {"num_local_experts", "num_experts_per_tok", "output_router_logits",
            "router_aux_loss_coef", "router_jitter_noise", "sliding_window"}
_MIXTRAL_REQUIRED = {"router_jitter_noise": (0.0, 0, None), "sliding_window": (None,)}
# Qwen3-MoE (Qwen3MoeForCausalLM): per-head q/k RMSNorm, routed experts on every layer
_QWEN3_MOE = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
              "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
              "router_aux_loss_coef", "sliding_window", "use_sliding_window", "max_window_layers"}
_QWEN3_MOE_REQUIRED = {"decoder_sparse_step": (1, None), "mlp_only_layers": ([], None),
                       "use_sliding_window": (False, None)}
_QWEN2_MOE = _QWEN3_MOE | {"shared_expert_intermediate_size", "qkv_bias", "layer_types"}
_QWEN2_MOE_REQUIRED = dict(_QWEN3_MOE_REQUIRED, layer_types=(None, "full_attention"))
# Qwen3 (Qwen3ForCausalLM): LLaMA with per-head q/k RMSNorm
_QWEN3 = {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}
_QWEN3_REQUIRED = {"use_sliding_window": (False, None)}
# OLMoE (OlmoeForCausalLM): q/k RMSNorm over the whole projection, routed experts of width
# intermediate_size on every layer, softmax over all experts (norm_topk_prob either way)
_OLMOE = {"num_experts", "num_experts_per_tok", "norm_topk_prob", "output_router_logits",
          "router_aux_loss_coef", "clip_qkv"}
_OLMOE_REQUIRED = {"clip_qkv": (None,)}
FAMILIES = ("llama", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama4_text")
# model types named and refused, with what is missing (one line each)
REFUSED_MODEL_TYPES = {
    "deepseek_v3": "DeepSeek-V3's multi-latent attention (MLA) is not supported",
    "gpt_oss": "GPT-OSS's MXFP4 expert weights (and its attention sinks) are not supported",
    "llama4": "the multimodal Llama 4 (vision encoder) is not supported; convert its text "
              "model (Llama4ForCausalLM, model_type llama4_text)",
}
# transformers 5 writes the chat template to chat_template.jinja (older ones: .json or inside
# tokenizer_config.json); without it an exported chat model cannot render its prompts.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("hf loader")
    group.add_argument("--allow-unknown-hf-fields", action="store_true",
                       help="convert even if config.json has fields this tool does not know")


def _rope(cfg: dict):
    """(theta, llama3 scaling dict or None) from old (rope_theta/rope_scaling) or new
    (rope_parameters) style configs."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ValueError(f"config.json: {key} is a {type(cfg[key]).__name__}, expected an "
                             "object (or null)")
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (params if params else None)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
    check_rope_scaling(scaling)
    if scaling is not None:
        scaling = {k: scaling[k] for k in ("rope_type", "factor", "low_freq_factor",
                                           "high_freq_factor", "original_max_position_embeddings")}
    return theta, scaling


# Sizes that must be positive integers where config.json gives them (the required ones are
# looked up later, naming the missing key).
_POSITIVE_INTS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")


def meta_from_hf_config(cfg: dict, path: str = "config.json", allow_unknown: bool = False) -> dict:
    """Model metadata (``ModelConfig`` field names) of a HuggingFace LLaMA ``config.json``.

    Raises:
        ValueError: not a LLaMA, a field at a value we do not implement (``attention_bias``,
            ``mlp_bias``, another activation, another ``rope_scaling`` type), or unknown fields.
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a JSON {type(cfg).__name__}, not an object: not a model's "
                         "config.json")
    for key in _POSITIVE_INTS:
        value = cfg.get(key, 1)
        if key in cfg and value is None and key in ("num_key_value_heads", "head_dim"):
            continue  # null: the default (one group per head, hidden / heads)
        if type(value) is not int or value < 1:
            raise ValueError(f"{path}: {key}={value!r} must be a positive integer; fix the "
                             "config or use the model's own config.json")
    model_type = cfg.get("model_type", "llama")
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r}: {REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in FAMILIES:
        raise ValueError(f"{path}: model_type {model_type!r} is not one of "
                         f"{', '.join(repr(f) for f in FAMILIES)}")
    if (model_type in ("qwen2_moe", "qwen3")
            and any(t != "full_attention" for t in cfg.get("layer_types") or [])):
        raise ValueError(f"{path}: layer_types {cfg['layer_types']!r}: sliding-window layers are "
                         "not supported")
    required = dict(_REQUIRED_VALUES, **{"mixtral": _MIXTRAL_REQUIRED, "qwen3_moe":
                                         _QWEN3_MOE_REQUIRED, "qwen2_moe": {
                                             k: v for k, v in _QWEN2_MOE_REQUIRED.items()
                                             if k != "layer_types"}, "qwen3": _QWEN3_REQUIRED,
                                         "olmoe": _OLMOE_REQUIRED,
                                         llama4_layout.MODEL_TYPE: llama4_layout.REQUIRED}.get(model_type, {}))
    for key, allowed in required.items():
        if cfg.get(key, allowed[0]) not in allowed:
            raise ValueError(f"{path}: {key}={cfg[key]!r} is not supported (only {allowed[0]!r}); "
                             "this model cannot be converted without changing its outputs")
    if cfg.get("attention_dropout", 0.0):
        raise ValueError(f"{path}: attention_dropout={cfg['attention_dropout']} is not converted; "
                         "set it to 0 and pass --attention-dropout when training")
    known = _HARMLESS | _IMPLEMENTED | {"mixtral": _MIXTRAL, "qwen3_moe": _QWEN3_MOE,
                                        "qwen2_moe": _QWEN2_MOE, "qwen3": _QWEN3,
                                        "olmoe": _OLMOE,
                                        llama4_layout.MODEL_TYPE: llama4_layout.FIELDS}.get(model_type, set())
    unknown = sorted(k for k in cfg if k not in known)
    if unknown and not allow_unknown:
        raise ValueError(f"{path}: fields {unknown} are not implemented by this converter; "
                         "remove them if they do not change the model, or pass "
                         "--allow-unknown-hf-fields to convert anyway")
    theta, scaling = _rope(cfg)
    heads = cfg["num_attention_heads"]
    meta = {
        "num_layers": cfg["num_hidden_layers"], "hidden_size": cfg["hidden_size"],
        "ffn_hidden_size": cfg["intermediate_size"], "num_attention_heads": heads,
        "num_query_groups": cfg.get("num_key_value_heads") or heads,
        "kv_channels": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "true_vocab_size": cfg["vocab_size"], "max_position_embeddings": cfg["max_position_embeddings"],
        "norm_epsilon": cfg.get("rms_norm_eps", 1e-6), "rotary_base": theta, "rope_scaling": scaling,
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
        "hf_token_ids": {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }
    if model_type in ("qwen2_moe", "qwen3_moe"):  # norm_topk_prob False: softmax over all E
        meta.update(num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                    moe_router_topk=cfg["num_experts_per_tok"],
                    moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                    moe_router_pre_softmax=not cfg.get("norm_topk_prob", False),
                    moe_aux_loss_coeff=cfg.get("router_aux_loss_coef", 0.0),
                    hf_architecture=model_type, qk_layernorm=model_type == "qwen3_moe")
    if model_type == "qwen2_moe":  # q/k/v biases; a shared expert with a sigmoid gate
        meta.update(add_qkv_bias=bool(cfg.get("qkv_bias", True)), moe_shared_expert_gate=True,
                    moe_shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"])
    if model_type == llama4_layout.MODEL_TYPE:  # docs/llama4.md
        meta.update(llama4_layout.meta_from_config(cfg, path))
    if model_type == "qwen3":  # LLaMA with per-head q/k RMSNorm
        meta.update(qk_layernorm=True, hf_architecture="qwen3")
    if model_type == "olmoe":  # q/k RMSNorm over the whole projection; softmax over all E
        meta.update(num_experts=cfg["num_experts"], moe_router_topk=cfg["num_experts_per_tok"],
                    moe_ffn_hidden_size=cfg["intermediate_size"],
                    moe_router_pre_softmax=not cfg.get("norm_topk_prob", False),
                    moe_aux_loss_coeff=cfg.get("router_aux_loss_coef", 0.0),
                    hf_architecture="olmoe", qk_layernorm=True, qk_layernorm_full_width=True)
    if model_type == "mixtral":  # Mixtral's router: softmax of the k top logits (docs/moe.md, routing recipes)
        meta.update(num_experts=cfg["num_local_experts"], moe_router_topk=cfg["num_experts_per_tok"],
                    moe_ffn_hidden_size=cfg["intermediate_size"], moe_router_pre_softmax=False,
                    moe_aux_loss_coeff=cfg.get("router_aux_loss_coef", 0.0), hf_architecture="mixtral")
    return meta


class MissingTensorError(KeyError, ValueError):
    """A tensor config.json needs is not in the folder's files: a KeyError for the code that
    looks tensors up, a ValueError (one line, exit 2) for ``convert.py``."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class HFWeights:
    """Lazy access to the tensors of a HuggingFace folder by name."""

    def __init__(self, folder: str):
        self.folder = folder
        index = find_file(folder, ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
        if index is not None:
            self.where = weight_map(index, folder)  # entries may not point outside the folder
        else:
            single = find_file(folder, ["model.safetensors", "pytorch_model.bin"])
            if single is None:
                raise FileNotFoundError(f"{folder} holds no model.safetensors(.index.json) nor "
                                        "pytorch_model.bin(.index.json)")
            self.where = None
            self.single = single
        self._open = {}

    def _file(self, path: str):
        if path not in self._open:
            if path.endswith(".safetensors"):  # a lying header: one line naming the file
                self._open[path] = open_safetensors(path)
            else:
                self._open[path] = load_torch_file(path)
        return self._open[path]

    def keys(self):
        if self.where is not None:
            return set(self.where)
        f = self._file(self.single)
        return set(f.keys())

    def get(self, name: str) -> torch.Tensor:
        path = self.where.get(name) if self.where is not None else self.single
        if path is None:
            raise MissingTensorError(f"{self.folder}: tensor {name} is missing from the checkpoint "
                                     "(config.json describes more than its files hold)")
        f = self._file(path)
        if path.endswith(".safetensors"):
            if name not in f.keys():
                raise MissingTensorError(f"{path}: tensor {name} is missing (config.json "
                                         "describes more than its files hold)")
            return f.get_tensor(name)
        if name not in f:
            raise MissingTensorError(f"{path}: tensor {name} is missing (config.json describes "
                                     "more than its files hold)")
        return f[name]


def load_checkpoint(args):
    """``(meta, stream)`` of the HuggingFace folder ``args.load_dir`` (see ``convert.py``)."""
    folder = args.load_dir
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"--load-dir {folder} has no config.json (not a HuggingFace folder)")
    refuse_custom_code(folder, "--load-dir")  # the model's and its tokenizer files' configs
    with open(cfg_path, encoding="utf-8") as f:
        meta = meta_from_hf_config(json.load(f), cfg_path, getattr(args, "allow_unknown_hf_fields", False))
    meta["tokenizer_dir"] = os.path.abspath(folder)  # recorded: valid from any directory
    weights = HFWeights(folder)
    _refuse_layers_beyond(weights.keys(), meta["num_layers"], cfg_path)
    first = weights.get("model.embed_tokens.weight")
    meta["params_dtype"] = {v: k for k, v in DTYPES.items()}[first.dtype]
    if first.shape[0] != meta["true_vocab_size"]:
        raise ValueError(f"{folder}: embed_tokens has {first.shape[0]} rows but config.json says "
                         f"vocab_size={meta['true_vocab_size']}")
    return meta, _stream(weights, meta)



def _refuse_layers_beyond(names, num_layers: int, cfg_path: str) -> None:
    """Refuse tensors of layers config.json does not count (they would be dropped silently).

    Raises:
        ValueError: naming the first such tensor and ``num_hidden_layers``.
    """
    extra = sorted((int(m.group(1)), n) for n in names
                   if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m.group(1)) >= num_layers)
    if extra:
        raise ValueError(f"{cfg_path}: num_hidden_layers={num_layers}, but the files hold "
                         f"{extra[0][1]} (layer {extra[0][0]}) and more: the config and the "
                         "weights disagree; use the model's own config.json")


def _router_name(keys, i: int) -> str:
    """The router weight of MoE layer ``i``: Mixtral's ``block_sparse_moe.gate.weight`` (the
    Hub's files) or ``mlp.gate.weight`` (transformers 5's in-memory name; Qwen3-MoE's), exactly
    one of them."""
    found = [n for n in (f"model.layers.{i}.block_sparse_moe.gate.weight",
                         f"model.layers.{i}.mlp.gate.weight") if n in keys]
    if len(found) != 1:
        raise moe_layout.ExpertError(f"layer {i}: router weight {'missing' if not found else 'stored twice'}"
                                     f" (block_sparse_moe.gate.weight / mlp.gate.weight)")
    return found[0]


def _expected_shapes(meta: dict) -> dict:
    """``{key: shape}`` of the dense tensors of a layer as config.json describes them
    (transformers' ``LlamaAttention`` / ``LlamaMLP``). QK norms are left out: per head (Qwen3)
    or over the whole projection (OLMoE)."""
    h, kv = meta["hidden_size"], meta["kv_channels"]
    q, g, f = meta["num_attention_heads"] * kv, meta["num_query_groups"] * kv, meta["ffn_hidden_size"]
    return {"input_norm": (h,), "post_norm": (h,), "q": (q, h), "k": (g, h), "v": (g, h),
            "o": (h, q), "q_bias": (q,), "k_bias": (g,),
            "v_bias": (g,), "gate": (f, h), "up": (f, h), "down": (h, f)}


def _check_shape(folder: str, name: str, tensor, shape: tuple) -> None:
    """Raise ValueError naming the tensor when its shape contradicts config.json (a weight file
    of another model, or an edited config): before, the converter wrote a checkpoint whose
    recorded sizes its tensors did not have."""
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{folder}: tensor {name} has shape {tuple(tensor.shape)} but config.json "
                         f"implies {tuple(shape)}; the weights and config.json are of different "
                         "models")


def _check_layer(weights: HFWeights, meta: dict, names: dict, i: int, layer: dict) -> None:
    """:func:`_check_shape` on layer ``i``'s dense tensors read by ``names``."""
    for key, shape in _expected_shapes(meta).items():
        if key in layer and key in names:
            _check_shape(weights.folder, f"model.layers.{i}.{names[key]}", layer[key], shape)


def _stream_llama4(weights: HFWeights, meta: dict, names: dict):
    """Llama 4's layers: MoE and dense ones by ``moe_layer_freq`` (the experts gated)."""
    gate = moe_layout.ExpertGate(meta, "hf loader")
    for i in range(meta["num_layers"]):
        layer = {k: weights.get(f"model.layers.{i}.{v}") for k, v in names.items()}
        _check_layer(weights, meta, names, i, layer)
        layer.update(llama4_layout.read_mlp(i, meta, weights.get))
        if "router" in layer:
            layer["expert_checksums"] = gate.layer(i, layer)
        yield "layer", layer
    gate.finish()


def _stream_layers(weights: HFWeights, meta: dict, names: dict):
    """The layers of a LLaMA, Mixtral or Qwen-MoE folder."""
    if meta.get("moe_shared_expert_intermediate_size"):
        names.update(moe_layout.HF_SHARED)
    if moe_layout.is_moe(meta):
        keys = weights.keys()
        index = moe_layout.hf_expert_index(keys)
        stray = sorted(i for i in index if i >= meta["num_layers"])
        if stray:
            raise moe_layout.ExpertError(f"experts of layer {stray[0]} present but config.json says "
                                         f"{meta['num_layers']} layers")
        gate = moe_layout.ExpertGate(meta, "hf loader")
    else:
        names.update(gate="mlp.gate_proj.weight", up="mlp.up_proj.weight",
                     down="mlp.down_proj.weight")
    for i in range(meta["num_layers"]):
        layer = {k: weights.get(f"model.layers.{i}.{v}") for k, v in names.items()}
        _check_layer(weights, meta, names, i, layer)
        if moe_layout.is_moe(meta):
            layer.update(moe_layout.read_hf_experts(index, i, meta, weights.get),
                         router=weights.get(_router_name(keys, i)))
            layer["expert_checksums"] = gate.layer(i, layer)
        yield "layer", layer
    if moe_layout.is_moe(meta):
        gate.finish()


def _stream(weights: HFWeights, meta: dict):
    embedding = weights.get("model.embed_tokens.weight")
    _check_shape(weights.folder, "model.embed_tokens.weight", embedding,
                 (meta["true_vocab_size"], meta["hidden_size"]))
    yield "embeddings", {"word_embeddings": embedding}
    names = {"input_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
             "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
             "o": "self_attn.o_proj.weight", "post_norm": "post_attention_layernorm.weight"}
    if meta.get("qk_layernorm"):
        names.update(q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
    if meta.get("add_qkv_bias"):
        names.update(q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias",
                     v_bias="self_attn.v_proj.bias")
    if meta.get("hf_architecture") == llama4_layout.MODEL_TYPE:
        yield from _stream_llama4(weights, meta, names)
    else:
        yield from _stream_layers(weights, meta, names)
    output = None
    if meta["untie_embeddings_and_output_weights"]:
        output = weights.get("lm_head.weight")
        _check_shape(weights.folder, "lm_head.weight", output,
                     (meta["true_vocab_size"], meta["hidden_size"]))
    yield "final", {"final_norm": weights.get("model.norm.weight"), "output_layer": output}
