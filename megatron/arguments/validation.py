"""Checks and derived values behind ``megatron.arguments.validate_args``.

Each ``_validate_*`` function checks one concern and raises
:class:`~megatron.usage_error.UsageError` (a ``ValueError``) naming the flag, its value and the
fix, e.g. ``--num-attention-heads (32) must be divisible by --tensor-model-parallel-size (3)``;
the ranges of the numbers come first (:mod:`megatron.arguments.ranges`), so no rule reads a NaN or
a negative size. A ``ValueError`` of a rule this module borrows (the model's attention and
recompute rules, the data builder's checks) leaves :func:`validate` as a ``UsageError`` too. Nothing here creates a process group or writes a file; the only
file-system access is checking that input files exist and reading each dataset's ``.idx``.

Flag policy (issue 3, item 8): a flag is implemented, or listed in :data:`IGNORED_FLAGS` (accepted,
no effect here, reported once), or listed in :data:`NOT_YET_SUPPORTED` (refused until the issue
that builds it lands and removes its entry).
"""

from __future__ import annotations

import os
import warnings
from typing import List

from megatron.arguments.moe import validate_moe
from megatron.arguments.ranges import check_ranges
from megatron.usage_error import UsageError

# dest -> (flag as users write it, the feature and issue that will build it).
NOT_YET_SUPPORTED = {
    "optimizer": ("--optimizer", "only adam (AdamW) is implemented"),
}

# dest -> (flag, why it has no effect here). Reported when the value differs from the default.
IGNORED_FLAGS = {
    "distributed_checkpointing": ("--distributed-checkpointing", "with --use-distributed-optimizer "
                                  "every data-parallel rank always writes its own optimizer shard "
                                  "(distrib_optim_dp_DDD.pt beside model_optim_rng.pt), re-cut at "
                                  "any DP size on load"),
    "use_flash_attn": ("--use-flash-attn", "attention always runs through torch "
                       "scaled_dot_product_attention, which picks the flash kernel where it applies"),
    "masked_softmax_fusion": ("--no-masked-softmax-fusion", "no fused softmax kernel (SDPA)"),
    "bias_dropout_fusion": ("--no-bias-dropout-fusion", "no fused bias-dropout kernel"),
    "bias_swiglu_fusion": ("--no-bias-swiglu-fusion", "no fused bias-SwiGLU kernel"),
    "apply_rope_fusion": ("--no-rope-fusion", "no fused RoPE kernel"),
    "attention_softmax_in_fp32": ("--attention-softmax-in-fp32",
                                  "SDPA accumulates the softmax in fp32 already"),
    "use_cpu_initialization": ("--use-cpu-initialization", "weights are always initialised on "
                               "CPU (layout-independent initialisation)"),
    "data_impl": ("--data-impl", "the mmap .bin/.idx format is the only one"),
    "auto_detect_ckpt_format": ("--auto-detect-ckpt-format", "--load always detects the format "
                                "of the checkpoint it reads (torch or torch_dist)"),
    "job_name": ("--job-name", "it is only recorded in the saved arguments"),
    "log_timers_to_tensorboard": ("--log-timers-to-tensorboard",
                                  "the iteration-time scalar is always written"),
    "log_batch_size_to_tensorboard": ("--log-batch-size-to-tensorboard",
                                      "the batch-size scalar is always written"),
    "log_validation_ppl_to_tensorboard": ("--log-validation-ppl-to-tensorboard",
                                          "the validation perplexity is always written"),
}

SENTENCEPIECE_TOKENIZERS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                            "Llama2Tokenizer")
HF_TOKENIZERS = ("HuggingFaceTokenizer", "PretrainedFromHF")


def validate(args, world_size: int, defaults: dict, check_files: bool = True):
    """Run every check in order and fill the derived values; see ``validate_args``.

    Raises:
        UsageError: the first check that fails.
    """
    try:
        return _validate_all(args, world_size, defaults, check_files)
    except UsageError:
        raise
    except ValueError as exc:  # a borrowed rule (attention, recompute, data): still the flags'
        raise UsageError(str(exc)) from exc


def _validate_all(args, world_size, defaults, check_files):
    _validate_required(args)
    check_ranges(args, defaults)
    _validate_precision(args)
    _validate_not_yet_supported(args, defaults)
    _validate_llama_architecture(args)
    _validate_model_shape(args)
    _validate_llama4_attention(args)
    validate_moe(args, defaults)
    _validate_parallel_layout(args, world_size)
    _validate_wandb(args)
    _validate_virtual_pipeline(args)
    _validate_sequence_parallel(args)
    _validate_context_parallel(args)
    _validate_recompute(args)
    _validate_batch(args)
    _validate_training_length(args)
    _validate_rampup(args)
    _validate_interleaved_microbatches(args)
    _validate_loss_scaling(args)
    _validate_learning_rate(args)
    _validate_distributed(args)
    _validate_distributed_optimizer(args)
    _validate_checkpointing(args)
    _validate_resume(args, check_files)
    _validate_data(args, check_files)
    _validate_tokenizer(args, check_files)
    return args


def ignored_flag_messages(args, defaults: dict) -> List[str]:
    """One message per given flag of :data:`IGNORED_FLAGS`."""
    return [f"{flag} has no effect here: {why}"
            for dest, (flag, why) in IGNORED_FLAGS.items()
            if getattr(args, dest, None) != defaults.get(dest)]


def _validate_required(args):
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "lr", "tokenizer_type"):
        if getattr(args, name) is None:
            raise UsageError(f"--{name.replace('_', '-')} is required")


def _validate_precision(args):
    if args.bf16 and args.fp16:
        raise UsageError("--bf16 and --fp16 are mutually exclusive: keep one (LLaMA: --bf16)")
    # bf16 gradients are accumulated and reduced in fp32 unless
    # --no-accumulate-allreduce-grads-in-fp32 asks for bf16 reduction.


def _validate_not_yet_supported(args, defaults):
    for dest, (flag, feature) in NOT_YET_SUPPORTED.items():
        value = getattr(args, dest, None)
        if value != defaults.get(dest):
            shown = "" if isinstance(value, bool) else f" ({value})"
            raise UsageError(f"{flag}{shown} is not supported yet ({feature}): remove the flag")


def _validate_llama_architecture(args):
    if args.normalization != "RMSNorm":
        raise UsageError(f"--normalization ({args.normalization}) is not supported: this codebase "
                         f"implements LLaMA, use --normalization RMSNorm (or --RMSNorm)")
    if args.position_embedding_type != "rope":
        raise UsageError(f"--position-embedding-type ({args.position_embedding_type}) is not "
                         f"supported: this codebase implements LLaMA, use "
                         f"--position-embedding-type rope (or --use-rotary-position-embeddings)")
    if args.causal_lm:
        args.untie_embeddings_and_output_weights = True
    low, high = args.rope_scaling_low_freq_factor, args.rope_scaling_high_freq_factor
    if args.use_rope_scaling and not high >= low:
        raise UsageError(f"--rope-scaling-high-freq-factor ({high}) must be at least "
                         f"--rope-scaling-low-freq-factor ({low}) with --use-rope-scaling (Llama "
                         "3.1's smooth band lies between them); Llama 3.1 uses 4 and 1, Llama 4 "
                         "Scout 1 and 1")


def _validate_llama4_attention(args):
    """``--no-rope-freq`` expanded to one 0/1 per layer (docs/llama4.md)."""
    from megatron.model.chunked_attention import no_rope_pattern

    if args.no_rope_freq is not None:
        try:
            args.no_rope_freq = no_rope_pattern(args.no_rope_freq, args.num_layers)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if args.attn_temperature_tuning and not any(args.no_rope_freq or ()):
        raise UsageError("--attn-temperature-tuning scales the queries of NoPE layers, and "
                         "there are none: give --no-rope-freq (Llama 4: 4) or drop the flag")


def _validate_model_shape(args):
    from megatron.model.attention import check_attention_config  # the model's own rule

    heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
    if args.group_query_attention:
        if args.num_query_groups is None:
            raise UsageError("--group-query-attention needs --num-query-groups "
                             "(the number of key/value heads)")
    elif args.num_query_groups not in (None, heads):
        raise UsageError(f"--num-query-groups ({args.num_query_groups}) is given without "
                         f"--group-query-attention: add --group-query-attention")
    else:
        args.num_query_groups = heads
    check_attention_config(args)  # heads and query groups split over TP, groups divide heads
    if args.kv_channels is None:
        if args.hidden_size % heads:
            raise UsageError(f"--hidden-size ({args.hidden_size}) must be divisible by "
                             f"--num-attention-heads ({heads}), or give --kv-channels")
        args.kv_channels = args.hidden_size // heads
    if args.ffn_hidden_size is None:
        # Megatron's SwiGLU default: 2/3 of 4h, rounded down to a multiple of 64.
        args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
    if args.ffn_hidden_size % tp:
        raise UsageError(f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp})")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise UsageError(f"--seq-length ({args.seq_length}) must be <= "
                         f"--max-position-embeddings ({args.max_position_embeddings}): raise "
                         f"--max-position-embeddings or shorten --seq-length")


def _validate_parallel_layout(args, world_size):
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = getattr(args, "context_parallel_size", 1)  # >= 1: megatron.arguments.ranges
    model = tp * pp * cp
    if world_size < 1 or world_size % model:
        with_cp = f" x --context-parallel-size ({cp})" if cp > 1 else ""
        raise UsageError(f"world size ({world_size}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size "
                         f"({pp}){with_cp} = {model}: change the sizes or the number of processes")
    if args.num_layers % pp:
        raise UsageError(f"--num-layers ({args.num_layers}) must be divisible by "
                         f"--pipeline-model-parallel-size ({pp})")
    args.world_size = world_size
    args.data_parallel_size = world_size // model
    _validate_expert_layout(args, world_size)


def _validate_expert_layout(args, world_size):
    """Megatron-Core's expert grid: expert-TP defaults to TP; EP x expert-TP divides the ranks
    of one pipeline stage (:func:`megatron.core.process_groups.expert_layout_error`)."""
    from megatron.core.process_groups import expert_layout_error

    if getattr(args, "expert_tensor_parallel_size", None) is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    args.expert_model_parallel_size = getattr(args, "expert_model_parallel_size", 1)
    error = expert_layout_error(world_size, args.tensor_model_parallel_size,
                                args.pipeline_model_parallel_size,
                                getattr(args, "context_parallel_size", 1),
                                args.expert_model_parallel_size,
                                args.expert_tensor_parallel_size)
    if error:
        raise UsageError(error)


# --cp-comm-type values: ours, Megatron-LM's spelling of the same, and Megatron-LM's not built here.
_CP_COMM_ALIASES = {"p2p": "p2p", "all_gather": "all_gather", "allgather": "all_gather"}
_CP_COMM_NOT_BUILT = ("a2a", "a2a+p2p")


def _validate_context_parallel(args):
    """Megatron-Core's context parallelism as built here: ``p2p`` or ``all_gather`` attention
    (one for every layer), causal masks only, no attention dropout, sequence split in 2 CP
    chunks (times TP under sequence parallelism). Normalizes ``cp_comm_type`` to one string."""
    from megatron.core.context_parallel.split import check_context_parallel_seq_length

    given = args.cp_comm_type if isinstance(args.cp_comm_type, (list, tuple)) else [
        args.cp_comm_type]
    for value in given:
        if value in _CP_COMM_NOT_BUILT:
            raise UsageError(f"--cp-comm-type {value} (all-to-all context parallelism) is not "
                             f"supported; use p2p or all_gather")
        if value not in _CP_COMM_ALIASES:
            raise UsageError(f"--cp-comm-type {value} is not one of p2p, all_gather (allgather)")
    kinds = sorted({_CP_COMM_ALIASES[v] for v in given})
    if len(kinds) != 1:
        raise UsageError(f"--cp-comm-type {' '.join(given)}: one communication type for every "
                         f"layer is supported; give one of p2p, all_gather")
    args.cp_comm_type = kinds[0]
    cp = args.context_parallel_size
    if cp == 1:
        return
    if args.attention_dropout > 0:
        raise UsageError(f"--attention-dropout ({args.attention_dropout}) must be 0 with "
                         f"--context-parallel-size ({cp}): the split attention has no dropout; "
                         f"pass --attention-dropout 0.0")
    check_context_parallel_seq_length(args.seq_length, cp, args.tensor_model_parallel_size,
                                      args.sequence_parallel)


def _validate_virtual_pipeline(args):
    """Megatron-LM's rules for the interleaved schedule: the virtual size is given, or derived
    as (layers per pipeline stage) / ``--num-layers-per-virtual-pipeline-stage``; each virtual
    stage holds a whole number of layers; interleaving needs PP > 1. A virtual size of 1 is the
    plain 1F1B schedule (same layers, same math) and is run as such."""
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    vp = args.virtual_pipeline_model_parallel_size
    if per_chunk is None and vp is None:
        return
    pp = args.pipeline_model_parallel_size
    per_stage = args.num_layers // pp
    flag = (f"--num-layers-per-virtual-pipeline-stage ({per_chunk})" if per_chunk is not None
            else f"--virtual-pipeline-model-parallel-size ({vp})")
    if (per_chunk is not None and per_chunk < 1) or (vp is not None and vp < 1):
        raise UsageError(f"{flag} must be >= 1")
    if pp == 1:
        raise UsageError(f"{flag} (the interleaved pipeline schedule) needs "
                         f"--pipeline-model-parallel-size > 1: raise it or remove the flag")
    if per_chunk is not None:
        if per_stage % per_chunk:
            raise UsageError(f"{flag} must divide the layers of a pipeline stage, --num-layers "
                             f"({args.num_layers}) / --pipeline-model-parallel-size ({pp}) = "
                             f"{per_stage}")
        if vp is not None and vp != per_stage // per_chunk:
            raise UsageError(f"--num-layers-per-virtual-pipeline-stage ({per_chunk}) gives "
                             f"{per_stage // per_chunk} virtual stages per pipeline rank, but "
                             f"--virtual-pipeline-model-parallel-size is {vp}: pass one of them")
        vp = per_stage // per_chunk
    elif per_stage % vp:
        raise UsageError(f"--num-layers ({args.num_layers}) must be divisible by "
                         f"--pipeline-model-parallel-size ({pp}) x {flag} = {pp * vp}")
    args.num_layers_per_virtual_pipeline_stage = per_stage // vp if vp > 1 else None
    args.virtual_pipeline_model_parallel_size = vp if vp > 1 else None


def _validate_interleaved_microbatches(args):
    """The interleaved schedule runs micro-batches in groups of PP: their number (every step of
    a ramp-up included) must be divisible by PP (Megatron-LM's rule)."""
    from megatron.core.num_microbatches_calculator import num_microbatches

    if args.virtual_pipeline_model_parallel_size is None:
        return
    pp = args.pipeline_model_parallel_size
    batches = [("--global-batch-size", args.global_batch_size)]
    if args.rampup_batch_size is not None:
        start, incr, _ = args.rampup_batch_size
        batches += [("the --rampup-batch-size START", start),
                     ("the --rampup-batch-size INCR", incr)]
    for what, batch in batches:
        count = num_microbatches(batch, args.micro_batch_size, args.data_parallel_size)
        if count % pp:
            raise UsageError(
                f"number of micro-batches ({count}: {what} ({batch}) / "
                f"(--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
                f"({args.data_parallel_size}))) must be divisible by "
                f"--pipeline-model-parallel-size ({pp}) with the interleaved schedule "
                f"(--virtual-pipeline-model-parallel-size "
                f"{args.virtual_pipeline_model_parallel_size}): change the batch sizes")


def _validate_sequence_parallel(args):
    tp = args.tensor_model_parallel_size
    if not args.sequence_parallel:
        return
    if tp == 1:
        # As Megatron-LM: nothing to split over one rank.
        warnings.warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1: "
                      "disabled")
        args.sequence_parallel = False
        return
    if args.seq_length % tp:
        raise UsageError(f"--seq-length ({args.seq_length}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp}) with --sequence-parallel")


def _validate_recompute(args):
    from megatron.model.recompute import check_recompute_config  # the model's own rule

    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            raise UsageError("--recompute-activations means --recompute-granularity selective; "
                             f"it contradicts --recompute-granularity {args.recompute_granularity}")
        args.recompute_granularity = "selective"
    layers = args.num_layers // args.pipeline_model_parallel_size
    vpp_layers = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    check_recompute_config(args.recompute_granularity, args.recompute_method,
                           args.recompute_num_layers, args.recompute_modules,
                           vpp_layers or layers)


def _validate_batch(args):
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    if gbs % (mbs * dp):
        raise UsageError(f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size "
                         f"({mbs}) x data-parallel size ({dp}) = {mbs * dp}")


def _validate_training_length(args):
    if (args.train_iters is None) == (args.train_samples is None):
        raise UsageError("give exactly one of --train-iters and --train-samples "
                         f"(got --train-iters {args.train_iters}, "
                         f"--train-samples {args.train_samples})")
    if args.eval_iters < 0:
        raise UsageError(f"--eval-iters ({args.eval_iters}) must be >= 0 (0 = no evaluation)")


def _validate_rampup(args):
    """Megatron's rule: a ramp-up is sample-based (``--train-samples``); each ramp step must be
    whole micro-batches on every data-parallel rank."""
    if args.rampup_batch_size is None:
        return
    from megatron.core.num_microbatches_calculator import build_num_microbatches_calculator

    shown = " ".join(map(str, args.rampup_batch_size))
    try:
        args.rampup_batch_size = [int(x) for x in args.rampup_batch_size]
    except ValueError:
        raise UsageError(f"--rampup-batch-size ({shown}) takes three integers: START INCR "
                         f"SAMPLES") from None
    if args.train_iters is not None:
        raise UsageError(f"--rampup-batch-size ({shown}) needs sample-based training (as in "
                         f"Megatron-LM): replace --train-iters ({args.train_iters}) by "
                         f"--train-samples, and --lr-*-iters by --lr-*-samples")
    start, incr, _ = args.rampup_batch_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if start % per_step or incr % per_step:
        raise UsageError(f"--rampup-batch-size ({shown}): START and INCR must be multiples of "
                         f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
                         f"({args.data_parallel_size}) = {per_step}")
    # The calculator's own checks (START <= global, INCR divides).
    build_num_microbatches_calculator(args.global_batch_size, args.micro_batch_size,
                                      args.data_parallel_size, args.rampup_batch_size)


def _validate_loss_scaling(args):
    if not args.fp16:
        return
    if args.loss_scale is None and args.min_loss_scale > args.initial_loss_scale:
        raise UsageError(f"--min-loss-scale ({args.min_loss_scale}) must be <= "
                         f"--initial-loss-scale ({args.initial_loss_scale})")
    if not args.accumulate_allreduce_grads_in_fp32:
        raise UsageError("--no-accumulate-allreduce-grads-in-fp32 goes with --bf16 only: fp16 "
                         "gradients are accumulated and reduced in fp32 (fp16 sums overflow); "
                         "remove the flag or use --bf16")


def _validate_learning_rate(args):
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters or args.lr_warmup_samples:
            raise UsageError("--lr-warmup-fraction and --lr-warmup-iters / --lr-warmup-samples "
                             "are mutually exclusive: keep one")
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise UsageError(f"--lr-warmup-fraction ({args.lr_warmup_fraction}) must be in [0, 1]")
    # As Megatron: the schedule is counted in the same unit as the training length.
    if args.train_iters is not None:
        if args.lr_decay_samples is not None or args.lr_warmup_samples:
            raise UsageError("--lr-decay-samples / --lr-warmup-samples go with --train-samples; "
                             "with --train-iters use --lr-decay-iters / --lr-warmup-iters")
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
    else:
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            raise UsageError("--lr-decay-iters / --lr-warmup-iters go with --train-iters; "
                             "with --train-samples use --lr-decay-samples / --lr-warmup-samples")
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
    _validate_warmup_within_decay(args)
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise UsageError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                         "are mutually exclusive: keep one")


def _validate_warmup_within_decay(args):
    """The scheduler's rule (warmup shorter than decay), said with the flags to change."""
    iters = args.train_iters is not None
    decay = args.lr_decay_iters if iters else args.lr_decay_samples
    warmup = args.lr_warmup_iters if iters else args.lr_warmup_samples
    if decay is None:
        return
    unit = "iters" if iters else "samples"
    given = f"--lr-warmup-{unit} ({warmup})"
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
        given = f"--lr-warmup-fraction ({args.lr_warmup_fraction})"
    if warmup and warmup >= decay:
        raise UsageError(f"{given} leaves no decay: the warmup ({warmup:g} {unit}) must be shorter "
                         f"than the decay (--lr-decay-{unit}, {decay}, which defaults to "
                         f"--train-{unit}); lower the warmup or raise --lr-decay-{unit}")


def _validate_distributed(args):
    if args.distributed_backend is None:
        import torch  # only to pick the default backend
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.local_rank is None:
        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))


def _validate_distributed_optimizer(args):
    if args.overlapped_distributed_optimizer:
        # Megatron-LLaMA's flag: the distributed optimizer with both overlaps.
        args.use_distributed_optimizer = True
        args.overlap_grad_reduce = True
        args.overlap_param_gather = True
    strategy = args.data_parallel_sharding_strategy
    if strategy != "no_shard" and not args.use_megatron_fsdp:
        raise ValueError(f"--data-parallel-sharding-strategy {strategy} needs --use-megatron-fsdp")
    if args.use_megatron_fsdp and strategy != "no_shard":
        args.use_distributed_optimizer = True  # the sharded optimizer state of every strategy
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise UsageError("--overlap-param-gather needs --use-distributed-optimizer (plain data "
                         "parallelism has no parameter all-gather): add it, or use "
                         "--overlapped-distributed-optimizer")
    if strategy == "optim_grads_params" and args.overlap_param_gather:
        raise ValueError("--overlap-param-gather (also set by --overlapped-distributed-optimizer) "
                         "does not apply to --data-parallel-sharding-strategy optim_grads_params: "
                         "its forward gathers each layer itself, with prefetch; drop it (keep "
                         "--overlap-grad-reduce)")
    if strategy == "optim_grads_params" and getattr(args, "async_save", False):
        raise ValueError("--async-save with --data-parallel-sharding-strategy optim_grads_params "
                         "is not supported yet (the host copy would read layers the next forward "
                         "frees); drop --async-save")
    if args.optimizer_cpu_offload and not args.use_distributed_optimizer:
        raise ValueError("--optimizer-cpu-offload needs --use-distributed-optimizer (or "
                         "--use-megatron-fsdp with a sharding strategy): it offloads the "
                         "distributed optimizer's shards")
    if args.optimizer_offload_fraction != 1.0:
        raise ValueError(f"--optimizer-offload-fraction ({args.optimizer_offload_fraction:g}) "
                         "is not supported: only 1.0 (all of the optimizer state on the host "
                         "with --optimizer-cpu-offload); drop the flag")


def _validate_wandb(args):
    from megatron.training.wandb_writer import wandb_flag_error

    error = wandb_flag_error(args.wandb_project, args.wandb_exp_name, args.wandb_save_dir,
                             args.save)
    if error:
        raise UsageError(error)


def _validate_checkpointing(args):
    if args.async_save and args.ckpt_format != "torch_dist":
        raise UsageError(f"--async-save needs --ckpt-format torch_dist (got --ckpt-format "
                         f"{args.ckpt_format}): legacy checkpoints are written synchronously")
    if (args.ckpt_convert_format is None) != (args.ckpt_convert_save is None):
        raise UsageError("--ckpt-convert-format and --ckpt-convert-save go together: give both "
                         "(e.g. --ckpt-convert-format torch_dist --ckpt-convert-save DIR)")
    if args.ckpt_convert_format is not None:
        if args.load is None:
            raise UsageError(f"--ckpt-convert-format {args.ckpt_convert_format} needs --load DIR "
                             "(the checkpoint to convert)")
        if os.path.abspath(args.ckpt_convert_save) == os.path.abspath(args.load):
            raise UsageError(f"--ckpt-convert-save ({args.ckpt_convert_save}) must differ from "
                             "--load: the converted checkpoint goes into a folder of its own")
    for flag, needs in (("save_interval", "save"), ("finetune", "load"), ("async_save", "save"),
                        ("use_checkpoint_args", "load"), ("no_load_optim", "load"),
                        ("no_load_rng", "load"), ("keep_last_checkpoints", "save"),
                        ("exit_signal_handler", "save")):
        value = getattr(args, flag)
        if value not in (None, False) and getattr(args, needs) is None:
            shown = "" if value is True else f" ({value})"
            raise UsageError(f"--{flag.replace('_', '-')}{shown} needs --{needs} DIR")


def _validate_resume(args, check_files):
    """``--load``'s tracker file, read once here (a line of text, nothing heavy): it must name an
    iteration or ``release`` and a checkpoint folder that exists, and a run that resumes (without
    ``--finetune``) must not end before the loaded iteration."""
    if not (check_files and args.load):
        return
    from megatron.checkpointing import (get_checkpoint_dir, get_checkpoint_tracker_filename,
                                        last_complete_hint, resume_point)
    from megatron.checkpointing.save_folder import check_load_folder

    # A mistyped --load must not train from scratch.
    check_load_folder(args.load, args.save,
                      checked_later=bool(args.finetune or getattr(args, "dpo", False)))
    from megatron.core.num_microbatches_calculator import train_iterations

    found = resume_point(args.load)
    if found is None:
        return
    iteration, release = found
    folder = get_checkpoint_dir(args.load, iteration, release)
    if not os.path.isdir(folder):
        raise UsageError(f"--load ({args.load}): {get_checkpoint_tracker_filename(args.load)} names "
                         f"{'release' if release else iteration}, but {folder} does not exist."
                         f"{last_complete_hint(args.load, folder)}")
    if release or args.finetune:
        return
    last = train_iterations(args.train_iters, args.train_samples,
                            global_batch_size=args.global_batch_size,
                            micro_batch_size=args.micro_batch_size,
                            data_parallel_size=args.data_parallel_size,
                            rampup_batch_size=args.rampup_batch_size)
    if last < iteration:
        length = (f"--train-iters ({args.train_iters})" if args.train_iters else
                  f"--train-samples ({args.train_samples}, {last} iterations)")
        raise UsageError(f"{length} ends before the checkpoint at --load {args.load} (iteration "
                         f"{iteration}): raise it above {iteration} to train on, or pass "
                         "--finetune to start a new run from its weights")


def _validate_data(args, check_files):
    """``--data-path``/``--split`` and the per-split paths through the dataset builder's own
    parser and checks (``megatron.data.blend_config``, ``check_train_valid_test_data``): what
    passes here is built exactly so. With ``check_files`` every dataset's ``.idx`` is read (not
    its ``.bin``): damaged, empty or too small datasets and splits are refused before anything is
    built. With ``--train-samples`` the number of evaluations is counted without a batch-size
    ramp-up (a lower bound), so a ramp-up's extra evaluations are not checked here."""
    from megatron.data.blend_config import split_sources
    from megatron.data.dataset_builder import (check_train_valid_test_data,
                                               get_train_valid_test_num_samples)

    if args.data_impl not in (None, "mmap", "infer"):
        raise UsageError(f"--data-impl ({args.data_impl}) is not supported: only mmap")
    if args.num_workers < 0:
        raise UsageError(f"--num-workers ({args.num_workers}) must be >= 0")
    if getattr(args, "mock_data", False):
        _validate_mock_data(args)
        return
    sources = split_sources(data_path=args.data_path, split=args.split,
                            train_data_path=args.train_data_path,
                            valid_data_path=args.valid_data_path,
                            test_data_path=args.test_data_path)
    evaluating = args.eval_iters > 0 and bool(args.eval_interval)
    if args.data_path is not None and sources[1] is None and evaluating:
        raise UsageError(f"--split ({args.split}): the validation share is 0, but --eval-iters "
                         f"({args.eval_iters}) and --eval-interval ({args.eval_interval}) ask for "
                         "evaluation; give validation a share (e.g. --split 98,2,0), or pass "
                         "--eval-iters 0")
    if check_files:
        samples = get_train_valid_test_num_samples(
            global_batch_size=args.global_batch_size, train_iters=args.train_iters,
            train_samples=args.train_samples, eval_interval=args.eval_interval,
            eval_iters=args.eval_iters)
        check_train_valid_test_data(sources, seq_length=args.seq_length, num_samples=samples,
                                    dataloader_type=args.dataloader_type)


def _validate_mock_data(args):
    """``--mock-data`` trains on synthetic tokens (megatron.data.mock_dataset): no data path may
    be given too (Megatron-LM would silently ignore it)."""
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        value = getattr(args, flag, None)
        if value is not None:
            name = "--" + flag.replace("_", "-")
            raise UsageError(f"--mock-data and {name} ({' '.join(map(str, value))}) are mutually "
                             f"exclusive: --mock-data trains on synthetic tokens; remove {name} "
                             "or --mock-data")


def _validate_tokenizer(args, check_files):
    kind = args.tokenizer_type
    if kind in SENTENCEPIECE_TOKENIZERS:
        if args.tokenizer_model is None:
            raise UsageError(f"--tokenizer-type {kind} needs --tokenizer-model "
                             f"(the SentencePiece .model file)")
        if check_files and not os.path.isfile(args.tokenizer_model):
            raise UsageError(f"--tokenizer-model ({args.tokenizer_model}) does not exist: give "
                             f"the path of the SentencePiece .model file")
    elif kind in HF_TOKENIZERS:
        folder = args.tokenizer_name_or_path or args.tokenizer_model
        if folder is None:
            raise UsageError(f"--tokenizer-type {kind} needs --tokenizer-name-or-path DIR (a local "
                             f"HuggingFace tokenizer folder)")
        if check_files and not os.path.isdir(folder):
            raise UsageError(f"--tokenizer-name-or-path ({folder}) is not a folder: give a local "
                             f"HuggingFace tokenizer folder (nothing is downloaded)")
    elif kind == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if path is None:
                raise UsageError(f"--tokenizer-type GPT2BPETokenizer needs {flag}")
            if check_files and not os.path.isfile(path):
                raise UsageError(f"{flag} ({path}) does not exist")
    elif kind == "NullTokenizer" and args.vocab_size is None:
        raise UsageError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.make_vocab_size_divisible_by < 1:
        raise UsageError(f"--make-vocab-size-divisible-by ({args.make_vocab_size_divisible_by}) "
                         f"must be >= 1")
