"""Command-line arguments with Megatron-LM's flag names (and Megatron-LLaMA's aliases).

``parse_args(argv)`` only parses; ``validate_args(args, world_size)`` checks every flag against the
others and against the world size, fills the derived values (``data_parallel_size``,
``global_batch_size`` default, ``ffn_hidden_size`` default, ...) and raises an error naming the
flag, its value and the fix. It runs before any process group is created or any file is written.
Errors of both are :class:`~megatron.usage_error.UsageError` (a ``ValueError``): the entry script
prints one line and exits 2.

Every flag is one of: implemented; accepted with no effect here (listed by
:func:`report_ignored_flags`, to be logged once); or refused with "not supported yet"
(:data:`megatron.arguments.validation.NOT_YET_SUPPORTED`, shrinking as later issues land).

Where Megatron-LM and Megatron-LLaMA name a flag differently both spellings are accepted and share
one ``dest``: ``--normalization RMSNorm`` / ``--RMSNorm``, ``--norm-epsilon`` /
``--layernorm-epsilon``, ``--position-embedding-type rope`` / ``--use-rotary-position-embeddings``,
``--data-impl`` / ``--dataset-impl``, ``--override-opt_param-scheduler`` /
``--override-opt-param-scheduler``.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
from typing import Callable, List, Optional

from megatron.arguments import help as arguments_help, validation as arguments_validation
from megatron.arguments.moe import _layer_freq_arg, add_moe_args
from megatron.tokenizer import add_tokenizer_args
from megatron.usage_error import UsageError

NOT_YET_SUPPORTED = arguments_validation.NOT_YET_SUPPORTED
IGNORED_FLAGS = arguments_validation.IGNORED_FLAGS

class _Parser(argparse.ArgumentParser):
    """argparse whose errors are :class:`UsageError` (one line, printed once by the entry point)
    instead of a usage block and ``SystemExit`` on every rank."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser(extra_args_provider: Optional[Callable] = None,
                 prog: str = "pretrain_llama.py") -> argparse.ArgumentParser:
    """Return the parser with every group of flags (and the caller's extra ones)."""
    parser = _Parser(prog=prog, description="Megatron-style LLaMA pretraining arguments",
                     allow_abbrev=False)
    for add in (_add_network_size_args, _add_regularization_args, _add_training_args,
                _add_kernel_args, _add_learning_rate_args, _add_mixed_precision_args,
                _add_distributed_args, _add_checkpointing_args, _add_data_args,
                add_tokenizer_args, _add_logging_args, add_moe_args):
        add(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return arguments_help.apply_help(parser)


def parse_args(argv: Optional[List[str]] = None,
               extra_args_provider: Optional[Callable] = None) -> argparse.Namespace:
    """Parse ``argv`` (``sys.argv[1:]`` when None). No validation: see :func:`validate_args`.

    Raises:
        UsageError: on unknown flags or malformed values (argparse's message, one line).
    """
    return build_parser(extra_args_provider).parse_args(argv)


@functools.lru_cache(maxsize=1)
def parser_defaults() -> dict:
    """The default value of every ``dest`` of :func:`build_parser` (no extra args)."""
    return vars(build_parser().parse_args([]))


def validate_args(args: argparse.Namespace, world_size: int, *,
                  check_files: bool = True) -> argparse.Namespace:
    """Check ``args`` for a run on ``world_size`` processes and fill the derived values in place.

    Derived: ``world_size``, ``data_parallel_size``, ``global_batch_size`` (micro-batch x DP when
    omitted), ``ffn_hidden_size`` (Megatron's SwiGLU rule when omitted), ``kv_channels``,
    ``num_query_groups`` (= heads without GQA), ``max_position_embeddings`` (= seq length when
    omitted), ``untie_embeddings_and_output_weights`` (implied by ``--causal-lm``),
    ``distributed_backend`` (nccl with CUDA, gloo otherwise), ``lr_decay_iters`` /
    ``lr_decay_samples`` (the training length when omitted), ``local_rank``. The padded
    vocabulary size needs the tokenizer: ``megatron.tokenizer.vocab_size_with_padding``.

    Args:
        args: the namespace from :func:`parse_args`.
        world_size: number of processes of the job (torchrun's ``WORLD_SIZE``).
        check_files: also check that data and tokenizer files exist (tests of the flags alone
            may turn it off).

    Returns:
        ``args`` itself.

    Raises:
        UsageError: (a ``ValueError``) for any inconsistent, unsupported, out-of-range or missing
            flag or file; the message names the flag, its value and the fix.
    """
    return arguments_validation.validate(args, world_size, parser_defaults(), check_files)


def report_ignored_flags(args: argparse.Namespace) -> List[str]:
    """Messages for the flags given that have no effect here, to be logged once by rank 0."""
    return arguments_validation.ignored_flag_messages(args, parser_defaults())


# Arguments of the model's shape, taken over by --use-checkpoint-args (Megatron-LM's list).
CHECKPOINT_MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
    "num_query_groups", "group_query_attention", "kv_channels", "max_position_embeddings",
    "position_embedding_type", "add_position_embedding", "use_rotary_position_embeddings",
    "rotary_base", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "qk_layernorm_full_width",
    "swiglu", "untie_embeddings_and_output_weights",
    "normalization", "norm_epsilon", "make_vocab_size_divisible_by", "padded_vocab_size",
    "tokenizer_type", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "use_rope_scaling", "rope_scaling_factor",
    "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings", "rotary_interleaved", "qk_l2_norm",
    "no_rope_freq", "attention_chunk_size", "attn_temperature_tuning",
    "attn_temperature_floor_scale", "attn_temperature_scale",
)


def load_args_from_checkpoint(args) -> list[str]:
    """``--use-checkpoint-args``: set the model-shape arguments from the checkpoint at
    ``args.load`` (before validation, so no process group is needed), ``--seq-length`` when
    the run gives none, and the checkpoint's tokenizer when the run names none
    (:func:`_tokenizer_from_checkpoint`).

    Returns:
        the names of the arguments that were set.

    Raises:
        CheckpointError: if ``--load`` has no checkpoint.
    """
    from megatron.checkpointing import (CheckpointError, TRACKER_FILENAME, find_checkpoint,
                                        get_checkpoint_dir, read_saved_args)

    found = find_checkpoint(args.load) if args.load else None
    if found is None:
        raise CheckpointError(f"--use-checkpoint-args needs a checkpoint, but --load {args.load} "
                              f"has no {TRACKER_FILENAME}")
    iteration, release = found
    folder = get_checkpoint_dir(args.load, iteration, release)
    from megatron.checkpointing import torch_dist

    layout = ()
    if torch_dist.is_torch_dist_checkpoint(folder):
        from megatron.checkpointing.foreign import megatron_lm_dist
        saved = (megatron_lm_dist.saved_args(folder) if megatron_lm_dist.is_megatron_lm(folder)
                 else dict(torch_dist.read_common(folder).get("args") or {}))
        # It loads at any layout: the run's parallel sizes stay its own.
        layout = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size")
    else:
        shards = sorted(glob.glob(os.path.join(folder, "mp_rank_*", "model_optim_rng.pt")))
        if not shards:
            raise CheckpointError(f"{folder} holds no mp_rank_*/model_optim_rng.pt")
        saved = read_saved_args(shards[0])
    changed = []
    for name in CHECKPOINT_MODEL_ARGS:
        if name in TOKENIZER_ARGS or (name == "seq_length"
                                      and getattr(args, "seq_length", None) is not None):
            continue  # the run's own choice (Megatron-LM sets seq_length only when not given)
        if name in saved and hasattr(args, name) and name not in layout:
            setattr(args, name, saved[name])
            changed.append(name)
    return changed + _tokenizer_from_checkpoint(args, saved, folder)


# The tokenizer flags --use-checkpoint-args takes from a checkpoint when the run gives none.
TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "tokenizer_name_or_path", "vocab_file",
                  "merge_file", "vocab_size")


def _tokenizer_from_checkpoint(args, saved: dict, folder: str) -> list[str]:
    """The checkpoint's tokenizer, unless the run names one: a tokenizer flag given on the
    command line is never overridden (not even by another flag of the checkpoint's tokenizer),
    as Megatron-LM's ``_set_arg`` leaves given values alone. A HuggingFace tokenizer recorded as
    ``tokenizer_model`` (the converter's and Megatron-LLaMA's way) becomes
    ``--tokenizer-name-or-path``. Returns the names set.

    Raises:
        UsageError: the run names no tokenizer and the checkpoint in ``folder`` records none this
            code builds (a converted or foreign checkpoint without tokenizer settings): the fix is
            a tokenizer flag, not the one validation would otherwise blame.
    """
    if any(getattr(args, name, None) is not None for name in TOKENIZER_ARGS):
        return []
    values = {name: saved.get(name) for name in TOKENIZER_ARGS}
    from megatron.tokenizer.tokenizer import TOKENIZER_TYPES

    if values["tokenizer_type"] not in TOKENIZER_TYPES:
        if not hasattr(args, "tokenizer_type"):  # a caller taking the model's shape only
            return []
        recorded = ("no tokenizer settings" if values["tokenizer_type"] is None else
                    f"the tokenizer type {values['tokenizer_type']!r}, which this code does not build")
        raise UsageError(f"--use-checkpoint-args: the checkpoint {folder} records {recorded}; "
                         "give the tokenizer: --tokenizer-type with --tokenizer-model (a "
                         "SentencePiece file), --tokenizer-name-or-path (a HuggingFace folder) or "
                         "--vocab-size (NullTokenizer)")
    if values["tokenizer_type"] in ("HuggingFaceTokenizer", "PretrainedFromHF"):
        values["tokenizer_name_or_path"] = (values["tokenizer_name_or_path"]
                                            or values["tokenizer_model"])
        values["tokenizer_model"] = None
    if values["tokenizer_type"] != "NullTokenizer":
        values["vocab_size"] = None  # the tokenizer's own; --vocab-size is NullTokenizer's
    changed = []
    for name, value in values.items():
        if value is not None:
            setattr(args, name, value)
            changed.append(name)
    return changed


def _add_network_size_args(parser):
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="SwiGLU inner width; default int(4h*2/3/64)*64 as Megatron")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads with --group-query-attention")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="per-head width; default hidden / heads")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="longest sequence the rotary tables cover; default --seq-length")
    g.add_argument("--normalization", default="RMSNorm", choices=["LayerNorm", "RMSNorm"],
                   help="LLaMA uses RMSNorm (LayerNorm is refused)")
    g.add_argument("--RMSNorm", dest="normalization", action="store_const", const="RMSNorm",
                   help="Megatron-LLaMA's spelling of --normalization RMSNorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float,
                   default=1e-5)
    g.add_argument("--swiglu", action="store_true", default=True,
                   help="SwiGLU MLP (always on: LLaMA's MLP)")
    g.add_argument("--position-embedding-type", default="rope",
                   choices=["learned_absolute", "rope", "none"],
                   help="LLaMA uses rope (the others are refused)")
    g.add_argument("--use-rotary-position-embeddings", dest="position_embedding_type",
                   action="store_const", const="rope")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="no learned absolute position embedding (always so: rotary only)")
    g.add_argument("--rotary-base", type=float, default=10000.0,
                   help="RoPE theta: 10000 (LLaMA-2), 500000 (Llama 3)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama-3.1 RoPE frequency scaling (Megatron-LM's flag; HF rope_type llama3)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="with --use-rope-scaling: long wavelengths divided by this (Llama 3.1: 8)")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=1.0,
                   help="with --use-rope-scaling: Llama 3.1's low_freq_factor (1)")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=4.0,
                   help="with --use-rope-scaling: Llama 3.1's high_freq_factor (4)")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=8192,
                   help="with --use-rope-scaling: context length before scaling (Llama 3.1: 8192)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   default=True)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias on the query/key/value projection only (Qwen2, Qwen2-MoE)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="RMSNorm of each query and key head before RoPE (Qwen3, Qwen3-MoE)")
    # Llama 4 (docs/llama4.md): Megatron-Core's names where it has them
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE on adjacent pairs (2i, 2i+1), Meta's complex convention (Llama 4)")
    g.add_argument("--qk-l2-norm", action="store_true",
                   help="weightless L2 (RMS) norm of q and k heads after RoPE, RoPE layers only "
                        "(Llama 4)")
    g.add_argument("--no-rope-freq", type=_layer_freq_arg, default=None,
                   help="NoPE layers: every N-th layer (N; Llama 4: 4) or a 0/1 pattern per "
                        "layer such as '([0]*3+[1]*1)*12' (1 = no RoPE)")
    g.add_argument("--attention-chunk-size", type=int, default=None,
                   help="chunked local attention of the RoPE layers, tokens per chunk "
                        "(Llama 4: 8192)")
    g.add_argument("--attn-temperature-tuning", action="store_true",
                   help="scale the NoPE layers' queries by 1 + scale * log(1 + floor((p + 1) / "
                        "floor_scale)) (Llama 4)")
    g.add_argument("--attn-temperature-floor-scale", type=float, default=8192.0,
                   help="Llama 4's floor_scale (tokens)")
    g.add_argument("--attn-temperature-scale", type=float, default=0.1,
                   help="Llama 4's attn_scale")
    g.add_argument("--qk-layernorm-full-width", action="store_true",
                   help="with --qk-layernorm: the norms over the whole q / k projection, not per "
                        "head (OLMoE); tensor-parallel size 1 only")
    g.add_argument("--causal-lm", action="store_true",
                   help="Megatron-LLaMA: LLaMA-style LM head, implies "
                        "--untie-embeddings-and-output-weights")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")


def _add_regularization_args(parser):
    g = parser.add_argument_group("regularization")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--optimizer", default="adam", help="only adam (AdamW, decoupled decay)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip; 0 = off")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="samples per micro-batch")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration; default micro-batch x data-parallel size")
    g.add_argument("--rampup-batch-size", nargs=3, default=None,
                   metavar=("START", "INCR", "SAMPLES"))
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop after the iteration that is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false",
                   help="let autograd build each weight gradient and add it to the fp32 main_grad "
                        "buffer, instead of accumulating it there inside the layer's backward")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (off by default; helps on GPUs)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="= --recompute-granularity selective")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="full recompute: uniform groups of --recompute-num-layers layers, or the "
                        "first --recompute-num-layers layers of each stage (block)")
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="+", default=None,
                   choices=["core_attn", "act", "layernorm", "mlp", "moe_act", "moe",
                            "shared_experts"],
                   help="selective recompute: what to recompute (default: core_attn act layernorm)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="norms and dropout on [s/TP, b, h] (needs TP > 1)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="normalise the loss by the unmasked tokens of the global batch")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")


def _add_kernel_args(parser):
    """GPU kernel selections of Megatron: accepted, without effect (see report_ignored_flags)."""
    g = parser.add_argument_group("kernels (no effect here)")
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion",
                   action="store_false")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--use-cpu-initialization", action="store_true")


def _add_learning_rate_args(parser):
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="default --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="default --train-samples")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of the decay length")
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="take the schedule from the flags, not from the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true")


def _add_mixed_precision_args(parser):
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true", help="bf16 model, fp32 main params and grads")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="constant fp16 loss scale")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--max-consecutive-nan-iterations", type=int, default=3,
                   help="stop training after this many non-finite iterations in a row (inf/NaN "
                        "loss or gradients; with --fp16, overflows at the lowest loss scale), each "
                        "skipped; 0 = never stop")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="max_consecutive_nan_iterations",
                   action="store_const", const=1,
                   help="Megatron-LM's flag: stop at the first non-finite iteration "
                        "(= --max-consecutive-nan-iterations 1)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="max_consecutive_nan_iterations",
                   action="store_const", const=0,
                   help="Megatron-LM's flag: never stop for non-finite iterations "
                        "(= --max-consecutive-nan-iterations 0)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", default=True,
                   help="fp32 gradient buffers and reduction (the default; Megatron's flag)")
    g.add_argument("--no-accumulate-allreduce-grads-in-fp32",
                   dest="accumulate_allreduce_grads_in_fp32", action="store_false",
                   help="with --bf16: accumulate and reduce gradients in bf16 (half the reduction "
                        "traffic and grad-buffer memory, less exact sums)")


def _add_distributed_args(parser):
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="CP: each sequence split over CP ranks (load-balanced causal split); "
                        "WORLD_SIZE = TP x CP x PP x DP")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP: ranks the experts are split over (Megatron-Core's expert grid, "
                        "order tp-ep-dp-pp); EP x expert-TP must divide TP x CP x DP")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="expert-TP: tensor parallelism inside each expert; default "
                        "--tensor-model-parallel-size")
    g.add_argument("--cp-comm-type", nargs="+", default=["p2p"],
                   help="context-parallel attention: p2p (ring exchange of K/V blocks) or "
                        "all_gather (Llama 3's all-gather of K/V; Megatron-LM's spelling "
                        "allgather too); one value for every layer")
    g.add_argument("--distributed-backend", default=None, choices=["gloo", "nccl"],
                   help="default nccl with CUDA, gloo on CPU")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="collective timeout; fractions of a minute allowed")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlapped-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="shard over data parallelism what --data-parallel-sharding-strategy "
                        "names (Megatron-Core's flag; built on our own buffers)")
    g.add_argument("--data-parallel-sharding-strategy", default="no_shard",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="with --use-megatron-fsdp: optim = the distributed optimizer (ZeRO-1), "
                        "optim_grads = and gradients (ZeRO-2), optim_grads_params = and "
                        "parameters, gathered per transformer layer (ZeRO-3)")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="distributed optimizer: fp32 main params and Adam moments in host "
                        "memory, the step on the CPU (ZeRO-Offload)")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="share of the optimizer state offloaded; only 1.0 is supported")
    g.add_argument("--reduce-bucket-size", type=float, default=None,
                   help="gradient bucket size in elements (e.g. 2e8); default Megatron-Core's "
                        "max(4e7, 1e6 x DP), one bucket for small models")
    g.add_argument("--distributed-checkpointing", action="store_true")
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None,
                   help="set by the launcher; default $LOCAL_RANK")


def _add_checkpointing_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint folder to write")
    g.add_argument("--load", default=None, help="checkpoint folder to resume from")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between saves")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only; iteration and optimizer start afresh")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model shape from the checkpoint's saved arguments")
    g.add_argument("--ckpt-format", default="torch", choices=["torch", "torch_dist"],
                   help="format written by --save: 'torch' (Megatron's legacy iter_*/mp_rank_* "
                        "files, one per TP x PP rank) or 'torch_dist' (distributed: every rank "
                        "writes its shards of layout-free tensors; loads at any TP/PP/DP layout)")
    g.add_argument("--async-save", action="store_true",
                   help="torch_dist: write checkpoints in the background while training goes on")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="accepted for Megatron-LM's scripts: --load always detects the format")
    g.add_argument("--ckpt-convert-format", default=None, choices=["torch", "torch_dist"],
                   help="load --load, save it in this format under --ckpt-convert-save/FORMAT, "
                        "and exit without training")
    g.add_argument("--ckpt-convert-save", default=None,
                   help="folder for --ckpt-convert-format (the checkpoint goes into FOLDER/FORMAT)")
    g.add_argument("--keep-last-checkpoints", type=int, default=None)


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--seq-length", type=int, default=None, help="tokens per sample")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="PREFIX, or WEIGHT PREFIX WEIGHT PREFIX ... (blend); split by --split")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--split", default="969, 30, 1",
                   help="train, valid, test proportions of --data-path")
    g.add_argument("--data-cache-path", default=None, help="folder for the sample-index cache")
    g.add_argument("--data-impl", "--dataset-impl", dest="data_impl", default=None,
                   help="only mmap (the .bin/.idx format); accepted for compatibility")
    g.add_argument("--dataloader-type", default="single", choices=["single", "cyclic"])
    g.add_argument("--num-workers", type=int, default=2, help="data-loader worker processes")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic tokens instead of --data-path (megatron.data.mock_dataset)")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one device (dense, training dtype) for the MFU of the "
                        "log line; e.g. 989 for an H100 SXM in bf16")
    g.add_argument("--measure-peak", action="store_true",
                   help="measure the peak for MFU at start-up (a short matmul benchmark in the "
                        "training dtype) instead of --peak-tflops")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--wandb-project", default=None,
                   help="Weights & Biases project: the last rank logs the TensorBoard scalars there "
                        "(needs the wandb extra: pip install -e '.[wandb]')")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run's name")
    g.add_argument("--wandb-save-dir", default=None,
                   help="folder of W&B's files; default {--save}/wandb")
    g.add_argument("--job-name", default=None)
