"""Saver ``--saver hf``: a HuggingFace LLaMA folder loadable by
``transformers.LlamaForCausalLM.from_pretrained``.

Writes sharded safetensors (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``,
or one ``model.safetensors``), a ``config.json`` with the true vocabulary size (padding rows are
never exported) and copies the tokenizer files. Tensors are buffered only up to
``--max-shard-size`` before a shard is written, and buffered on disk (memory-mapped spill files),
so the anonymous memory held is about one layer whatever the shard size.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file
from megatron.hf_folder import refuse_custom_code
from tools.checkpoint import llama4_layout, moe_layout
from tools.checkpoint.layout import DTYPES
from tools.checkpoint.loader_hf import TOKENIZER_FILES
from tools.checkpoint.tokenizer_files import tokenizer_info

_HF_LAYER = {"input_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
             "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
             "o": "self_attn.o_proj.weight", "post_norm": "post_attention_layernorm.weight",
             "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def add_arguments(parser) -> None:
    group = parser.add_argument_group("hf saver")
    group.add_argument("--max-shard-size", type=_size, default=_size("5GB"),
                       help="largest safetensors shard, e.g. 2GB, 500MB or bytes (default 5GB)")
    group.add_argument("--tokenizer-dir", default=None,
                       help="folder whose tokenizer files are copied (default: the source's)")


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = str(text).strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * factor)
    return int(t)


def hf_config(meta: dict, dtype: torch.dtype, tokenizer_dir: str | None = None) -> dict:
    """``config.json`` of the model (``LlamaConfig`` fields, both rope spellings for old and new
    transformers). BOS / EOS ids: the source's, else those of the tokenizer files in
    ``tokenizer_dir`` (:func:`tools.checkpoint.tokenizer_files.tokenizer_info`), else None."""
    rope = {"rope_type": "default"} if meta.get("rope_scaling") is None else dict(meta["rope_scaling"])
    ids = {k: v for k, v in tokenizer_info(tokenizer_dir).items() if k != "vocab_size"}
    ids.update({k: v for k, v in (meta.get("hf_token_ids") or {}).items() if v is not None})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": meta["true_vocab_size"], "hidden_size": meta["hidden_size"],
        "intermediate_size": meta["ffn_hidden_size"], "num_hidden_layers": meta["num_layers"],
        "num_attention_heads": meta["num_attention_heads"],
        "num_key_value_heads": meta["num_query_groups"], "head_dim": meta["kv_channels"],
        "max_position_embeddings": meta["max_position_embeddings"],
        "rms_norm_eps": meta["norm_epsilon"], "rope_theta": meta["rotary_base"],
        "rope_scaling": meta.get("rope_scaling"),
        "rope_parameters": dict(rope, rope_theta=meta["rotary_base"]),
        "tie_word_embeddings": not meta["untie_embeddings_and_output_weights"],
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "bos_token_id": ids.get("bos_token_id"), "eos_token_id": ids.get("eos_token_id"),
        "pad_token_id": ids.get("pad_token_id"),
    }
    if meta.get("hf_architecture") == llama4_layout.MODEL_TYPE:
        config.update(llama4_layout.hf_config(meta))
    elif moe_layout.is_moe(meta):
        config.update(mixtral_config(meta))
    else:
        config.update(dense_config(meta))
    return config


def dense_config(meta: dict) -> dict:
    """The architecture fields of a dense checkpoint: LLaMA, or Qwen3 with ``--qk-layernorm``.

    Raises:
        ValueError: settings neither can express (q/k/v biases, a full-width q/k norm).
    """
    if meta.get("add_qkv_bias") or meta.get("qk_layernorm_full_width"):
        raise ValueError("--saver hf: a dense model with "
                         f"{'--add-qkv-bias' if meta.get('add_qkv_bias') else '--qk-layernorm-full-width'}"
                         " is not exported (LLaMA and Qwen3 have neither)")
    if not meta.get("qk_layernorm"):
        return {}
    n = meta["num_layers"]
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": n,
            "layer_types": ["full_attention"] * n}


def mixtral_config(meta: dict) -> dict:
    """``MixtralConfig`` fields of a MoE checkpoint.

    Raises:
        ValueError: MoE settings Mixtral cannot express (its router is the softmax of the k top
            logits; every expert and the dense width are one ``intermediate_size``).
    """
    arch = meta.get("hf_architecture")
    shared = meta.get("moe_shared_expert_intermediate_size")
    if arch == "qwen2_moe" or shared:
        if not (shared and meta.get("moe_shared_expert_gate")) or meta.get("qk_layernorm"):
            raise ValueError("--saver hf: a shared expert is exported as Qwen2-MoE, which needs "
                             "--moe-shared-expert-gate and no --qk-layernorm")
        return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                "intermediate_size": meta["ffn_hidden_size"],
                "moe_intermediate_size": meta["moe_ffn_hidden_size"],
                "shared_expert_intermediate_size": shared, "qkv_bias": bool(meta.get("add_qkv_bias")),
                "num_experts": meta["num_experts"],
                "num_experts_per_tok": meta["moe_router_topk"],
                "norm_topk_prob": not meta.get("moe_router_pre_softmax"),
                "decoder_sparse_step": 1, "mlp_only_layers": [],
                "router_aux_loss_coef": meta.get("moe_aux_loss_coeff") or 0.0,
                "output_router_logits": False, "use_sliding_window": False}
    if meta.get("add_qkv_bias"):
        raise ValueError("--saver hf: q/k/v biases (--add-qkv-bias) without a shared expert: no "
                         "exported architecture has them; not exported")
    if arch == "olmoe" or meta.get("qk_layernorm_full_width"):
        if not (meta.get("qk_layernorm") and meta.get("qk_layernorm_full_width")):
            raise ValueError("--saver hf: OLMoE needs --qk-layernorm --qk-layernorm-full-width")
        if meta["kv_channels"] * meta["num_attention_heads"] != meta["hidden_size"]:
            raise ValueError(f"--saver hf: OLMoE's head width is hidden_size / heads, not "
                             f"--kv-channels {meta['kv_channels']}; not exported")
        return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
                "intermediate_size": meta["moe_ffn_hidden_size"],
                "num_experts": meta["num_experts"], "num_experts_per_tok": meta["moe_router_topk"],
                "norm_topk_prob": not meta.get("moe_router_pre_softmax"),
                "router_aux_loss_coef": meta.get("moe_aux_loss_coeff") or 0.0,
                "output_router_logits": False, "clip_qkv": None}
    if arch == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "intermediate_size": meta["ffn_hidden_size"],
                "moe_intermediate_size": meta["moe_ffn_hidden_size"],
                "num_experts": meta["num_experts"], "num_local_experts": meta["num_experts"],
                "num_experts_per_tok": meta["moe_router_topk"],
                "norm_topk_prob": not meta.get("moe_router_pre_softmax"),
                "decoder_sparse_step": 1, "mlp_only_layers": [],
                "router_aux_loss_coef": meta.get("moe_aux_loss_coeff") or 0.0,
                "output_router_logits": False, "use_sliding_window": False,
                "sliding_window": None}
    if meta.get("moe_router_pre_softmax"):
        raise ValueError("--saver hf: --moe-router-pre-softmax (softmax over all experts, no "
                         "renormalisation) is not Mixtral's router; not exported")
    if meta.get("qk_layernorm"):
        raise ValueError("--saver hf: Mixtral has no q/k layernorm (--qk-layernorm); not exported")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": meta["moe_ffn_hidden_size"],
            "num_local_experts": meta["num_experts"], "num_experts_per_tok": meta["moe_router_topk"],
            "router_aux_loss_coef": meta.get("moe_aux_loss_coeff") or 0.0,
            "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}


def moe_tensors(layer: int, payload: dict, architecture: str = "mixtral"):
    """``(name, tensor)`` of a MoE layer's router and experts in the Hub's per-expert on-disk
    layout (Mixtral's ``block_sparse_moe.experts.{e}.w1 / w2 / w3.weight``, Qwen3-MoE's
    ``mlp.experts.{e}.gate_proj / up_proj / down_proj.weight``, read by every transformers
    version's ``from_pretrained``)."""
    block, parts = moe_layout.HF_EXPERT_NAMES[architecture]
    prefix = f"model.layers.{layer}.{block}"
    yield f"{prefix}.gate.weight", payload["router"]
    for e in range(payload["experts_gate"].shape[0]):
        for part, key in parts.items():
            yield f"{prefix}.experts.{e}.{part}.weight", payload[key][e]


class _ShardWriter:
    """Buffers tensors up to ``max_bytes`` per shard, each message's tensors spilled to a
    ``.spill`` file and held memory-mapped (file-backed pages the kernel can drop), so the
    anonymous memory is about one layer, not one shard; ``save_file`` writes a shard straight
    from those mappings."""

    def __init__(self, folder: str, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.pending, self.pending_bytes, self.files, self.weight_map = {}, 0, [], {}
        self.fresh, self.spills, self.total = {}, [], 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if (self.pending or self.fresh) and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.fresh[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total += nbytes

    def spill(self) -> None:
        """Move the tensors added since the last spill out of anonymous memory."""
        if not self.fresh:
            return
        path = os.path.join(self.folder, f".spill-{len(self.files):05d}-{len(self.spills)}.pt")
        # clone: a view (the unpadded vocabulary rows) would otherwise save its whole storage
        torch.save({k: v if v.untyped_storage().nbytes() == v.numel() * v.element_size()
                    else v.clone() for k, v in self.fresh.items()}, path)
        self.spills.append(path)
        self.pending.update(load_torch_file(path, what="spill file", mmap=True, verify=False))
        self.fresh = {}

    def flush(self) -> None:
        from safetensors.torch import save_file

        self.spill()
        if not self.pending:
            return
        tmp = os.path.join(self.folder, f"shard-{len(self.files):05d}.tmp")
        save_file(self.pending, tmp, metadata={"format": "pt"})
        # safetensors creates its file with mode 0600; the shards are read like the other
        # outputs (config.json, tokenizer files): the mode open() gives under the umask.
        os.chmod(tmp, 0o666 & ~_umask())
        self.files.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0
        for path in self.spills:
            os.remove(path)
        self.spills = []

    def finish(self) -> None:
        self.flush()
        n = len(self.files)
        for i, (tmp, names) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.folder, final))
            self.weight_map.update({k: final for k in names})
        if n > 1:
            with open(os.path.join(self.folder, "model.safetensors.index.json"), "w",
                      encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": self.weight_map},
                          f, indent=2, sort_keys=True)


def save_checkpoint(meta: dict, stream, args) -> str:
    """Consume the loader's stream; write the HuggingFace folder ``args.save_dir``.

    Raises:
        ValueError: the true vocabulary size is unknown (padding rows would leak into the export),
            or a target tensor/pipeline/expert-parallel size other than 1 was asked for.
        FileExistsError: ``--save-dir`` already holds a model.
        ValueError: the tokenizer folder to copy asks to run its own code
            (:func:`megatron.hf_folder.refuse_custom_code`).
    """
    if any((getattr(args, f"target_{kind}_parallel_size", None) or 1) != 1
           for kind in ("tensor", "pipeline", "expert", "expert_tensor")):
        raise ValueError("--saver hf writes one unsharded model: drop "
                         "--target-tensor/pipeline/expert/expert-tensor-parallel-size")
    if not meta.get("true_vocab_size"):
        raise ValueError("the checkpoint does not store its true vocabulary size, so padding rows "
                         "cannot be removed: pass --true-vocab-size N (the tokenizer's vocabulary)")
    tokenizer = _tokenizer_source(args, meta)
    if tokenizer and os.path.isdir(tokenizer):  # its files go beside the model: checked first
        refuse_custom_code(tokenizer, "--tokenizer-dir" if args.tokenizer_dir else
                           "the source's tokenizer folder")
    folder = args.save_dir
    if os.path.exists(os.path.join(folder, "config.json")):
        raise FileExistsError(f"--save-dir {folder} already holds a model; choose an empty folder")
    os.makedirs(folder, exist_ok=True)
    dtype = DTYPES[args.target_params_dtype or meta.get("params_dtype") or "fp32"]
    writer = _ShardWriter(folder, args.max_shard_size)
    llama4 = meta.get("hf_architecture") == llama4_layout.MODEL_TYPE
    if moe_layout.is_moe(meta):
        if not llama4:  # refused before anything is written; a training checkpoint records no
            # hf_architecture, its settings name it (OLMoE's full-width q/k norm, a shared expert)
            moe_architecture = mixtral_config(meta)["model_type"]
        experts = moe_layout.ExpertGate(meta, "hf saver")
    layer, reward = 0, False
    for kind, payload in stream:
        if kind == "embeddings":
            writer.add("model.embed_tokens.weight", payload["word_embeddings"].to(dtype))
        elif kind == "layer":
            dense = _HF_LAYER
            if llama4:  # MoE and dense layers interleaved, the experts gated
                dense = {k: v for k, v in _HF_LAYER.items() if k not in ("gate", "up", "down")}
                if "router" in payload:
                    experts.layer(layer, payload, payload.get("expert_checksums"))
                for name, tensor in llama4_layout.write_mlp(layer, payload).items():
                    writer.add(name, tensor.to(dtype))
            elif moe_layout.is_moe(meta):
                dense = {k: v for k, v in _HF_LAYER.items() if k not in ("gate", "up", "down")}
                experts.layer(layer, payload, payload.get("expert_checksums"))
                for name, tensor in moe_tensors(layer, payload, moe_architecture):
                    writer.add(name, tensor.to(dtype))
            if meta.get("add_qkv_bias"):
                dense = dict(dense, q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias",
                             v_bias="self_attn.v_proj.bias")
            if meta.get("moe_shared_expert_intermediate_size") and not llama4:
                dense = dict(dense, **moe_layout.HF_SHARED)
            if meta.get("qk_layernorm"):
                dense = dict(dense, q_norm="self_attn.q_norm.weight",
                             k_norm="self_attn.k_norm.weight")
            for key, name in dense.items():
                writer.add(f"model.layers.{layer}.{name}", payload[key].to(dtype))
            layer += 1
        elif kind == "final":
            writer.add("model.norm.weight", payload["final_norm"].to(dtype))
            if payload.get("reward_head") is not None:  # LlamaForSequenceClassification's
                writer.add("score.weight", payload["reward_head"].to(dtype))
                reward = True
            elif payload["output_layer"] is not None:
                writer.add("lm_head.weight", payload["output_layer"].to(dtype))
        writer.spill()
        del payload  # else it lives on while the loader builds the next message
    if moe_layout.is_moe(meta):
        experts.finish()
    writer.finish()
    _copy_tokenizer(tokenizer, folder, named_by_checkpoint=not args.tokenizer_dir)
    config = hf_config(meta, dtype, folder)
    if reward:  # a reward model: one score per sequence, read at its last non-padding token
        config.update(architectures=["LlamaForSequenceClassification"], num_labels=1,
                      id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return folder


# The largest SentencePiece model copied from a path the checkpoint names (LLaMA's: 0.5 MB).
_SP_MODEL_MAX_BYTES = 64 * 2 ** 20


def _loads(path: str, max_bytes: int, load) -> bool:
    """Whether ``path`` is a regular file of at most ``max_bytes`` that ``load(path)`` reads
    without raising (the size is checked first: nothing large is read)."""
    if not os.path.isfile(path) or os.path.getsize(path) > max_bytes:
        return False
    try:
        load(path)
    except Exception:  # noqa: BLE001 - each library raises its own types for a malformed file
        return False
    return True


def _is_sentencepiece_model(path: str) -> bool:
    """Whether ``path`` is a regular file SentencePiece loads as a model (size-capped first)."""
    import sentencepiece

    return _loads(path, _SP_MODEL_MAX_BYTES,
                  lambda p: sentencepiece.SentencePieceProcessor(model_file=p))


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _tokenizer_source(args, meta: dict):
    """Where the export's tokenizer files come from: ``--tokenizer-dir``, else the path the
    checkpoint records (``tokenizer_dir`` / ``tokenizer_model``) when it lies inside
    ``--load-dir``, else None after one line naming the recorded path and the flag. A path
    recorded in a checkpoint someone else wrote may name any file of this machine (a private
    tokenizer at a guessable path): it is neither read nor copied into a folder one publishes
    unless the user names it."""
    if args.tokenizer_dir:
        return args.tokenizer_dir
    recorded = meta.get("tokenizer_dir") or meta.get("tokenizer_model")
    if not recorded:
        return None
    load_dir = getattr(args, "load_dir", None)
    if load_dir and _inside(recorded, load_dir):
        return recorded
    print(f" no tokenizer files copied: the checkpoint records {recorded}, outside --load-dir; "
          f"pass --tokenizer-dir {recorded} to copy its tokenizer files into the export")
    return None


# The largest tokenizer.json read from a folder the checkpoint names (Llama 4's: 27 MB).
_TOKENIZER_JSON_MAX_BYTES = 256 * 2 ** 20


def _is_tokenizers_json(path: str) -> bool:
    """Whether ``path`` is a regular file the ``tokenizers`` library loads (size-capped first)."""
    from tokenizers import Tokenizer

    return _loads(path, _TOKENIZER_JSON_MAX_BYTES, Tokenizer.from_file)


def _holds_a_tokenizer(source: str) -> bool:
    """Whether the folder ``source`` holds a tokenizer that loads: a SentencePiece
    ``tokenizer.model`` or a ``tokenizers`` ``tokenizer.json``."""
    return (_is_sentencepiece_model(os.path.join(source, "tokenizer.model"))
            or _is_tokenizers_json(os.path.join(source, "tokenizer.json")))


def _copy_tokenizer(source, folder: str, named_by_checkpoint: bool = False) -> None:
    """Copy the tokenizer files of ``source`` (a folder, or a SentencePiece model file) into the
    export. What the checkpoint names (its recorded ``--tokenizer-model`` or HF folder, not
    ``--tokenizer-dir``) is copied only if it is a tokenizer: a model file SentencePiece loads,
    or a folder holding a ``tokenizer.model`` or ``tokenizer.json`` that loads. A path recorded
    in a downloaded checkpoint must not put any file of this machine into the folder one
    publishes."""
    if not source:
        print(" no tokenizer files copied (the source names none; pass --tokenizer-dir)")
        return
    if os.path.isfile(source):  # a SentencePiece model file
        if named_by_checkpoint and not _is_sentencepiece_model(source):
            print(f" tokenizer.model not copied: {source}, the checkpoint's recorded "
                  "--tokenizer-model, is not a SentencePiece model; pass --tokenizer-dir with "
                  "the tokenizer's files")
            return
        shutil.copy2(source, os.path.join(folder, "tokenizer.model"))
        return
    if named_by_checkpoint and not _holds_a_tokenizer(source):
        print(f" no tokenizer files copied: {source}, the folder the checkpoint records, holds "
              "no tokenizer.model or tokenizer.json that loads; pass --tokenizer-dir with the "
              "tokenizer's files")
        return
    for name in TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(folder, name))
