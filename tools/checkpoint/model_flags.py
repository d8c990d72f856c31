"""The ``pretrain_llama.py`` flags a converted checkpoint needs, from the ``args`` it records.

``convert.py --saver megatron`` prints them after writing (``--loader hf`` in particular: a
HuggingFace ``config.json`` is not Megatron's flags), and ``--use-checkpoint-args`` reads the
same recorded values (``megatron.arguments.load_args_from_checkpoint``), so both give one model.
"""

from __future__ import annotations

import os
import shlex

from tools.checkpoint import moe_layout

HF_TOKENIZER_TYPES = ("HuggingFaceTokenizer", "PretrainedFromHF")
# a HuggingFace folder is a usable tokenizer when it holds one of these
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _number(value) -> str:
    """A float flag value as typed: ``50000`` for 50000.0, ``1e-06`` for 1e-6."""
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def tokenizer_flags(saved: dict) -> list[str]:
    """The tokenizer flags of the recorded ``saved`` args, or [] when they name none usable (a
    HuggingFace folder without tokenizer files)."""
    kind = saved.get("tokenizer_type")
    if kind in HF_TOKENIZER_TYPES:
        folder = saved.get("tokenizer_name_or_path") or saved.get("tokenizer_model")
        if folder and any(os.path.isfile(os.path.join(folder, f)) for f in HF_TOKENIZER_FILES):
            return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path", folder]
        return []
    if kind and saved.get("tokenizer_model"):
        return ["--tokenizer-type", kind, "--tokenizer-model", saved["tokenizer_model"]]
    return []


def pretrain_flags(saved: dict) -> list[str]:
    """The model, layout and tokenizer flags of a checkpoint whose ``args`` are ``saved``
    (:func:`tools.checkpoint.saver_megatron.checkpoint_args`): everything that fixes the model's
    function and the checkpoint's tensor shapes. LLaMA has no dropout (the converters refuse a
    non-zero one), so both are 0."""
    flags = ["--num-layers", saved["num_layers"], "--hidden-size", saved["hidden_size"],
             "--ffn-hidden-size", saved["ffn_hidden_size"],
             "--num-attention-heads", saved["num_attention_heads"]]
    if saved.get("num_query_groups") not in (None, saved["num_attention_heads"]):
        flags += ["--group-query-attention", "--num-query-groups", saved["num_query_groups"]]
    flags += ["--kv-channels", saved["kv_channels"],
              "--max-position-embeddings", saved["max_position_embeddings"],
              "--normalization", "RMSNorm", "--norm-epsilon", _number(saved["norm_epsilon"]),
              "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
              "--rotary-base", _number(saved["rotary_base"])]
    if saved.get("use_rope_scaling"):
        flags += ["--use-rope-scaling",
                  "--rope-scaling-factor", _number(saved["rope_scaling_factor"]),
                  "--rope-scaling-low-freq-factor", _number(saved["rope_scaling_low_freq_factor"]),
                  "--rope-scaling-high-freq-factor",
                  _number(saved["rope_scaling_high_freq_factor"]),
                  "--rope-scaling-original-max-position-embeddings",
                  saved["rope_scaling_original_max_position_embeddings"]]
    if saved.get("untie_embeddings_and_output_weights"):
        flags.append("--untie-embeddings-and-output-weights")
    if saved.get("qk_layernorm"):
        flags.append("--qk-layernorm")
    if saved.get("qk_layernorm_full_width"):
        flags.append("--qk-layernorm-full-width")
    if saved.get("add_qkv_bias"):
        flags.append("--add-qkv-bias")
    flags += moe_flags(saved) + llama4_flags(saved)
    flags += ["--hidden-dropout", "0", "--attention-dropout", "0",
              "--make-vocab-size-divisible-by", saved["make_vocab_size_divisible_by"],
              "--tensor-model-parallel-size", saved.get("tensor_model_parallel_size", 1),
              "--pipeline-model-parallel-size", saved.get("pipeline_model_parallel_size", 1)]
    if saved.get("num_experts") and saved.get("tensor_model_parallel_size", 1) > 1:
        # MoE at TP > 1 trains with SP (each tensor rank routes its share of the tokens) and
        # the experts split as these shards hold them: whole (1) or over the tensor ranks
        flags += ["--sequence-parallel", "--expert-tensor-parallel-size",
                  moe_layout.saved_expert_tp(saved)]
    if (saved.get("expert_model_parallel_size") or 1) > 1:  # its shards hold E / EP experts
        flags += ["--expert-model-parallel-size", saved["expert_model_parallel_size"]]
    return [str(f) for f in flags + tokenizer_flags(saved)]


def moe_flags(saved: dict) -> list:
    """The MoE flags of a MoE checkpoint (Megatron-Core's names; [] for a dense one): experts,
    their width, the router's k and its softmax placement (docs/moe.md, routing recipes), and
    the load-balancing coefficient the source trained with."""
    if not saved.get("num_experts"):
        return []
    flags = ["--num-experts", saved["num_experts"],
             "--moe-ffn-hidden-size", saved.get("moe_ffn_hidden_size") or saved["ffn_hidden_size"],
             "--moe-router-topk", saved.get("moe_router_topk", 2)]
    if saved.get("moe_router_pre_softmax"):
        flags.append("--moe-router-pre-softmax")
    if saved.get("moe_shared_expert_intermediate_size"):
        flags += ["--moe-shared-expert-intermediate-size",
                  saved["moe_shared_expert_intermediate_size"]]
        if saved.get("moe_shared_expert_gate"):
            flags.append("--moe-shared-expert-gate")
    if saved.get("moe_aux_loss_coeff"):
        flags += ["--moe-aux-loss-coeff", _number(saved["moe_aux_loss_coeff"])]
    if saved.get("moe_router_score_function", "softmax") != "softmax":
        flags += ["--moe-router-score-function", saved["moe_router_score_function"]]
    if saved.get("moe_apply_probs_on_input"):
        flags.append("--moe-apply-probs-on-input")
    freq = saved.get("moe_layer_freq", 1)
    if isinstance(freq, (list, tuple)) and not all(freq):
        flags += ["--moe-layer-freq", _pattern(freq)]
    return flags


def _pattern(values) -> str:
    """A per-layer 0/1 pattern as ``--moe-layer-freq`` / ``--no-rope-freq`` read it."""
    return "[" + ",".join(str(int(v)) for v in values) + "]"


def llama4_flags(saved: dict) -> list:
    """Llama 4's attention flags (docs/llama4.md; [] for other models)."""
    flags = []
    if saved.get("rotary_interleaved"):
        flags.append("--rotary-interleaved")
    if saved.get("qk_l2_norm"):
        flags.append("--qk-l2-norm")
    if saved.get("no_rope_freq") is not None and any(saved["no_rope_freq"]):
        flags += ["--no-rope-freq", _pattern(saved["no_rope_freq"])]
    if saved.get("attention_chunk_size"):
        flags += ["--attention-chunk-size", saved["attention_chunk_size"]]
    if saved.get("attn_temperature_tuning"):
        flags += ["--attn-temperature-tuning", "--attn-temperature-floor-scale",
                  _number(saved["attn_temperature_floor_scale"]), "--attn-temperature-scale",
                  _number(saved["attn_temperature_scale"])]
    return flags


def describe(saved: dict, save_dir: str, folder: str) -> str:
    """What ``convert.py`` prints after writing ``folder`` under ``save_dir``: the flags, and
    how to load it (a release of weights: ``--finetune``)."""
    flags = pretrain_flags(saved) + ["--load", save_dir]
    if os.path.basename(folder) == "release":
        flags.append("--finetune")
    line = " ".join(shlex.quote(f) for f in flags)
    note = ("" if tokenizer_flags(saved) else
            "; add the tokenizer's flags (the source names no usable tokenizer), with "
            f"--make-vocab-size-divisible-by {saved['make_vocab_size_divisible_by']} its "
            f"{saved['true_vocab_size']} ids pad to this checkpoint's {saved['padded_vocab_size']} rows")
    return (f"pretrain_llama.py flags of this checkpoint (--use-checkpoint-args reads the same "
            f"from it): {line}{note}; add the data and training flags (--seq-length at most "
            f"{saved['max_position_embeddings']})")
