"""Loader ``--loader megatron-llama``: checkpoints of Alibaba's Megatron-LLaMA, as its conversion
tool (``tools/checkpoint_conversion/llama_checkpoint_conversion.py``) and its training
``save_checkpoint`` write them.

Layout: ``release/`` or ``iter_XXXXXXX/`` with ``mp_rank_TT[_PPP][_dp_DDD]/model_optim_rng.pt``
(``_dp_000`` with ``--distributed-checkpointing``; folders holding only ``optim.pt`` or
``distrib_optim.pt``, written for the distributed optimizer, are skipped); ``model`` holds
``language_model.embedding.word_embeddings.weight`` (vocabulary partition, first stage; padded by
repeating the last row), ``language_model.encoder.layers.N.*`` (N local to the stage) with
per-rank ``[Q; K; V]`` and ``[gate; up]`` blocks in HF row order,
``language_model.encoder.final_layernorm.weight`` and ``lm_head.weight`` (the whole output matrix,
replicated on every tensor-parallel rank, last stage). Weights may be fp32, bf16 or fp16.

``args`` is a ``types.SimpleNamespace`` (the conversion tool: 14 fields, no norm epsilon) or the
training run's ``argparse.Namespace`` (with ``megatron.core.enums.ModelType``); both are read as
plain data (:mod:`megatron.core.dist_checkpointing.safe_pickle`), never by running the pickle. What
the args do not say:

- the norm epsilon (the tool stores none): ``--norm-epsilon``, else the conversion fails naming it;
- RoPE theta: Megatron-LLaMA hard-codes 10000 (``megatron/model/rotary_pos_embedding.py``);
- the true vocabulary: the tool's ``orig_vocab_size``, else ``--true-vocab-size``, else the
  tokenizer that ``save_checkpoint`` writes into the checkpoint folder (``len(tokenizer)``).
"""

from __future__ import annotations

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.foreign import MEGATRON_LLAMA, describe, identify
from megatron.checkpointing.foreign.megatron_lm import setting
from megatron.core.dist_checkpointing.safe_pickle import flatten, load_raw
from tools.checkpoint.layout import DTYPES
from tools.checkpoint.loader_megatron import (add_foreign_arguments, find_shards, meta_from_args,
                                              stream_stages)
from tools.checkpoint.tokenizer_files import tokenizer_info

NAMES = {"embedding": "language_model.embedding.word_embeddings.weight",
         "layer": "language_model.encoder.layers.{}.",
         "final_norm": "language_model.encoder.final_layernorm.weight",
         "output_replicated": "lm_head.weight"}
ROTARY_BASE = 10000.0  # Megatron-LLaMA's RotaryEmbedding: 1 / 10000 ** (2i / d)
# args fields, where recorded, that must have our LLaMA's value
_REQUIRED = {"swiglu": True, "RMSNorm": True, "add_bias_linear": False,
             "use_rotary_position_embeddings": True, "rotary_percent": 1.0,
             "apply_layernorm_1p": False, "group_query_attention": False}


def add_arguments(parser) -> None:
    add_foreign_arguments(parser.add_argument_group("megatron-llama loader"))


def model_args(saved: dict, source: str, args, notes: list) -> dict:
    """Our model arguments from Megatron-LLaMA's ``args`` (plain dict), flags filling the gaps.

    Raises:
        CheckpointError: a field at a value this LLaMA does not implement, or the norm epsilon
            neither recorded nor given (names ``--norm-epsilon``).
    """
    for field, want in _REQUIRED.items():
        if field in saved and saved[field] is not None and saved[field] != want:
            raise CheckpointError(f"{source} has {field}={saved[field]!r}; this LLaMA needs "
                                  f"{field}={want!r}")
    if getattr(args, "rotary_base", None) not in (None, ROTARY_BASE):
        notes.append(f"--rotary-base {args.rotary_base} overrides Megatron-LLaMA's hard-coded "
                     f"theta {ROTARY_BASE:g}")
    heads = saved["num_attention_heads"]
    out = {k: saved.get(k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                     "max_position_embeddings", "seq_length",
                                     "make_vocab_size_divisible_by")}
    out.update(
        num_attention_heads=heads, num_query_groups=heads,
        kv_channels=saved.get("kv_channels") or saved["hidden_size"] // heads,
        norm_epsilon=setting(saved, ("layernorm_epsilon",), "--norm-epsilon",
                             getattr(args, "norm_epsilon", None), source, notes),
        rotary_base=getattr(args, "rotary_base", None) or ROTARY_BASE,
        untie_embeddings_and_output_weights=True,  # lm_head, whatever the args say (--causal-lm)
        max_position_embeddings=getattr(args, "max_position_embeddings", None)
        or saved["max_position_embeddings"])
    return out


def load_checkpoint(args):
    """``(meta, stream)`` of the Megatron-LLaMA checkpoint under ``args.load_dir``.

    Raises:
        CheckpointError: not a Megatron-LLaMA checkpoint, a refused pickle (named), args that
            disagree with the folder's layout, or a value the model needs that is missing.
    """
    folder, shards, tp, pp = find_shards(args.load_dir)
    foreign = identify(shards[(0, 0)])
    if foreign is None or foreign.system != MEGATRON_LLAMA:
        what = describe(foreign) if foreign is not None else "one of ours"
        raise CheckpointError(f"--load-dir {args.load_dir} is {what}, not Megatron-LLaMA's: use "
                              "--loader megatron")
    saved, source = foreign.args, foreign.path
    for name, flag in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if saved.get(name, flag) != flag:
            raise CheckpointError(f"{folder}: args say {name}={saved[name]} but the folder holds "
                                  f"{flag} shards")
    notes = []
    ours = model_args(saved, source, args, notes)
    tokenizer = tokenizer_info(args.load_dir)
    true_vocab = (getattr(args, "true_vocab_size", None) or saved.get("orig_vocab_size")
                  or tokenizer.get("vocab_size"))
    embedding = flatten(foreign.state["model"])[NAMES["embedding"]]
    meta = meta_from_args(ours, embedding.shape[0] * tp, true_vocab)
    meta["params_dtype"] = {v: k for k, v in DTYPES.items()}[embedding.dtype]
    if tokenizer:  # save_checkpoint / the tool copy the tokenizer files into the root
        meta["tokenizer_dir"] = args.load_dir
    elif saved.get("tokenizer_type") == "PretrainedFromHF":
        meta["tokenizer_type"] = "PretrainedFromHF"
        meta["tokenizer_model"] = saved.get("tokenizer_name_or_path")
    if tokenizer.get("bos_token_id") is not None or tokenizer.get("eos_token_id") is not None:
        meta["hf_token_ids"] = {k: tokenizer.get(k) for k in ("bos_token_id", "eos_token_id")}
    for note in notes:
        print(f" {note}")
    stages = [[lambda t=t, p=p: flatten(load_raw(shards[(t, p)])["model"]) for t in range(tp)]
              for p in range(pp)]
    return meta, stream_stages(stages, meta, names=NAMES)

