"""Saver ``--saver megatron``: a ``release/`` checkpoint in our (Megatron legacy) layout at the
target TP/PP, loadable by ``megatron.checkpointing.load_checkpoint`` (``--load DIR --finetune``).

Streaming: one pipeline stage (all its tensor-parallel partitions) is held at a time and written
as soon as its last layer arrives; the word embedding is kept until the stages that need it
(first, and last when tied with PP > 1) are written. Files are written under ``release.tmp/`` and
the folder and the tracker are put in place only after every file exists.
"""

from __future__ import annotations

import os
import shutil

import torch

from megatron.checkpointing import CHECKPOINT_VERSION, get_checkpoint_name, get_checkpoint_tracker_filename
from megatron.tokenizer import vocab_size_with_padding
from tools.checkpoint.layout import DTYPES, check_layout, layer_to_partitions, pad_vocab, split


def add_arguments(parser) -> None:
    group = parser.add_argument_group("megatron saver")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                       help="vocabulary padding multiple (per TP rank); default: the source's, else 128")


def checkpoint_args(meta: dict, tp: int, pp: int, padded: int, dtype: str, divisible_by: int) -> dict:
    """The ``args`` entry (plain values; the names ``--use-checkpoint-args`` takes over)."""
    return {
        "num_layers": meta["num_layers"], "hidden_size": meta["hidden_size"],
        "ffn_hidden_size": meta["ffn_hidden_size"], "num_attention_heads": meta["num_attention_heads"],
        "num_query_groups": meta["num_query_groups"],
        "group_query_attention": meta["num_query_groups"] != meta["num_attention_heads"],
        "kv_channels": meta["kv_channels"], "max_position_embeddings": meta["max_position_embeddings"],
        "seq_length": meta.get("seq_length") or meta["max_position_embeddings"],
        "position_embedding_type": "rope", "use_rotary_position_embeddings": True,
        "add_position_embedding": False, "rotary_base": meta["rotary_base"],
        "rope_scaling": meta.get("rope_scaling"), "add_bias_linear": False, "swiglu": True,
        "untie_embeddings_and_output_weights": meta["untie_embeddings_and_output_weights"],
        "normalization": "RMSNorm", "norm_epsilon": meta["norm_epsilon"],
        "make_vocab_size_divisible_by": divisible_by, "padded_vocab_size": padded,
        "true_vocab_size": meta["true_vocab_size"],
        "tokenizer_type": meta.get("tokenizer_type") or ("PretrainedFromHF" if meta.get("tokenizer_dir") else None),
        "tokenizer_model": meta.get("tokenizer_model") or meta.get("tokenizer_dir"),
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "bf16": dtype == "bf16", "fp16": dtype == "fp16", "params_dtype": dtype,
        "hf_token_ids": meta.get("hf_token_ids"),
    }


def save_checkpoint(meta: dict, stream, args) -> str:
    """Consume the loader's stream; write ``args.save_dir/release``. Returns that folder.

    Raises:
        ValueError: the target layout does not divide the model (before anything is written).
        FileExistsError: ``--save-dir`` already holds a checkpoint.
    """
    tp = args.target_tensor_parallel_size or 1
    pp = args.target_pipeline_parallel_size or 1
    check_layout(meta, tp, pp)
    dtype_name = args.target_params_dtype or meta.get("params_dtype", "fp32")
    dtype = DTYPES[dtype_name]
    divisible_by = (args.make_vocab_size_divisible_by or meta.get("make_vocab_size_divisible_by")
                    or 128)
    vocab_rows = meta["true_vocab_size"] or meta["vocab_rows"]
    padded = vocab_size_with_padding(vocab_rows, divisible_by, tp)
    save = args.save_dir
    if os.path.exists(get_checkpoint_tracker_filename(save)):
        raise FileExistsError(f"--save-dir {save} already holds a checkpoint; choose an empty folder")
    staging = os.path.join(save, "release.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    ckpt_args = checkpoint_args(meta, tp, pp, padded, dtype_name, divisible_by)
    per_stage = meta["num_layers"] // pp

    def cast(t):
        return t.detach().to(dtype).contiguous()

    def vocab_parts(weight):
        return split(pad_vocab(cast(weight), padded), tp, 0)

    embedding = None
    stage, states = 0, [dict() for _ in range(tp)]
    for kind, payload in stream:
        if kind == "embeddings":
            embedding = payload["word_embeddings"]
            for r, part in enumerate(vocab_parts(embedding)):
                states[r]["word_embeddings.weight"] = part
        elif kind == "layer":
            local = sum(k.endswith("input_layernorm.weight") for k in states[0])
            for r, part in enumerate(layer_to_partitions({k: cast(v) for k, v in payload.items()}, tp)):
                states[r].update({f"layers.{local}.{k}": v for k, v in part.items()})
            if local + 1 == per_stage and stage < pp - 1:
                _write(staging, states, stage, pp, ckpt_args)
                stage, states = stage + 1, [dict() for _ in range(tp)]
                if meta["untie_embeddings_and_output_weights"]:
                    embedding = None  # no later stage needs it: free it
        elif kind == "final":
            for r in range(tp):
                states[r]["final_layernorm.weight"] = cast(payload["final_norm"])
            if meta["untie_embeddings_and_output_weights"]:
                for r, part in enumerate(vocab_parts(payload["output_layer"])):
                    states[r]["output_layer.weight"] = part
            elif pp > 1:
                for r, part in enumerate(vocab_parts(embedding)):
                    states[r]["word_embeddings_for_head.weight"] = part
            _write(staging, states, stage, pp, ckpt_args)
        else:
            raise ValueError(f"unknown message {kind!r} from the loader")
    final = os.path.join(save, "release")
    os.replace(staging, final)
    tracker = get_checkpoint_tracker_filename(save)
    with open(tracker + ".tmp", "w", encoding="utf-8") as f:
        f.write("release")
    os.replace(tracker + ".tmp", tracker)
    return final


def _write(staging: str, states, stage: int, pp: int, ckpt_args: dict) -> None:
    for r, state in enumerate(states):
        name = get_checkpoint_name(staging, 0, release=False, pipeline_parallel=pp > 1,
                                   tensor_rank=r, pipeline_rank=stage)
        # get_checkpoint_name adds iter_0000000/; the staging folder stands for release/.
        name = name.replace(os.path.join(staging, "iter_0000000"), staging, 1)
        os.makedirs(os.path.dirname(name), exist_ok=True)
        torch.save({"model": state, "args": ckpt_args, "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": 0, "optimizer": None, "opt_param_scheduler": None,
                    "rng_state": None}, name)
