"""The one place that reads the validated argparse namespace: it builds the frozen
:class:`~megatron.config.Config` and computes every derived value once.

``main()`` parses, validates (``megatron.arguments.validate_args``, which fills Megatron's
defaults: data-parallel size, ffn width, kv channels, lr decay length, ...), builds the tokenizer
and calls :func:`build_config`; nothing below ``pretrain()`` reads the namespace. Derived here:
the padded vocabulary (and the true one, the tokenizer's), the parameter dtype, the RoPE scaling
dict, the number of micro-batches, the iterations of a sample-based run and the schedule's lengths
in samples.

Every flag of ``megatron.arguments.build_parser`` lands in a field named like its ``dest``, or is
listed in :data:`FLAGS_NOT_IN_CONFIG` with the reason (tested both ways).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import DataConfig
from megatron.config.logging import LoggingConfig
from megatron.config.model import ModelConfig
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.training import TrainingConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig, SchedulerConfig

# dest -> why no field holds it.
FLAGS_NOT_IN_CONFIG = {
    "normalization": "LLaMA's RMSNorm is the only normalization: validation refuses another",
    "position_embedding_type": "rotary embeddings only: validation refuses another",
    "swiglu": "LLaMA's MLP is always SwiGLU",
    "no_position_embedding": "there is no learned absolute position embedding to turn off",
    "group_query_attention": "validation turns it into num_query_groups",
    "causal_lm": "Megatron-LLaMA's flag: validation turns it into "
                 "--untie-embeddings-and-output-weights",
    "recompute_activations": "validation turns it into --recompute-granularity selective",
    "use_megatron_fsdp": "validation turns it into use_distributed_optimizer for a sharding "
                         "strategy (data_parallel_sharding_strategy carries the rest)",
    "overlapped_distributed_optimizer": "Megatron-LLaMA's flag: validation turns it into "
                                        "--use-distributed-optimizer with both overlaps",
    "use_rope_scaling": "with --rope-scaling-*, becomes ModelConfig.rope_scaling",
    "rope_scaling_factor": "becomes ModelConfig.rope_scaling (with --use-rope-scaling)",
    "rope_scaling_low_freq_factor": "becomes ModelConfig.rope_scaling",
    "rope_scaling_high_freq_factor": "becomes ModelConfig.rope_scaling",
    "rope_scaling_original_max_position_embeddings": "becomes ModelConfig.rope_scaling",
    "local_rank": "set by the launcher; the device follows $LOCAL_RANK as torchrun sets it",
    "auto_detect_ckpt_format": "no effect: --load always detects the format it reads",
    "use_checkpoint_args": "main() applies it to the namespace before validation "
                           "(megatron.arguments.load_args_from_checkpoint)",
    # Accepted without effect and reported once (megatron.arguments.validation.IGNORED_FLAGS):
    "distributed_checkpointing": "no effect: every DP rank always writes its optimizer shard",
    "use_flash_attn": "no effect: attention runs through torch SDPA",
    "masked_softmax_fusion": "no effect: no fused softmax kernel (SDPA)",
    "bias_dropout_fusion": "no effect: no fused bias-dropout kernel",
    "bias_swiglu_fusion": "no effect: no fused bias-SwiGLU kernel",
    "apply_rope_fusion": "no effect: no fused RoPE kernel",
    "attention_softmax_in_fp32": "no effect: SDPA accumulates the softmax in fp32",
    "use_cpu_initialization": "no effect: weights are always initialised on the CPU",
    "data_impl": "no effect: the mmap .bin/.idx format is the only one",
    "log_timers_to_tensorboard": "no effect: the iteration-time scalar is always written",
    "log_batch_size_to_tensorboard": "no effect: the batch-size scalar is always written",
    "log_validation_ppl_to_tensorboard": "no effect: the validation perplexity is always written",
}


def builtin_dests() -> set:
    """Every ``dest`` of the built-in flags: the fields of the built-in sections and the flags
    listed in :data:`FLAGS_NOT_IN_CONFIG` (``tests/unit/test_config.py`` holds that the parser's
    dests are exactly these)."""
    classes = (ModelConfig, ParallelConfig, OptimizerConfig, SchedulerConfig, TrainingConfig,
               DataConfig, CheckpointConfig, LoggingConfig, MoEConfig)
    return {f.name for cls in classes for f in dataclasses.fields(cls)} | set(FLAGS_NOT_IN_CONFIG)


def params_dtype_from_args(args) -> torch.dtype:
    """The model parameter dtype selected by ``--bf16`` / ``--fp16`` (fp32 otherwise)."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


def _tuple(value):
    return None if value is None else tuple(value)


def _from_args(cls, args, **derived):
    """Build ``cls`` from the ``args`` attributes named like its fields (plus ``derived``).

    Attributes absent from ``args`` keep the field's default, so a namespace made by hand (tests,
    tools) needs only the fields without defaults.
    """
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in derived:
            values[f.name] = derived[f.name]
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return cls(**values)


def rope_scaling_from_args(args) -> Optional[dict]:
    """``ModelConfig.rope_scaling`` from Megatron-LM's ``--use-rope-scaling`` and
    ``--rope-scaling-*`` flags: HuggingFace's Llama-3.1 dict (``rope_type: llama3``), or None.

    A namespace without the flags (made by hand) may carry the dict as ``args.rope_scaling``.

    Raises:
        ValueError: a non-positive factor or ``--rope-scaling-high-freq-factor`` below the low
            one (equal ones, as Llama 4 Scout's, leave no band to interpolate).
    """
    if not getattr(args, "use_rope_scaling", False):
        return getattr(args, "rope_scaling", None)
    scaling = {"rope_type": "llama3", "factor": float(args.rope_scaling_factor),
               "low_freq_factor": float(args.rope_scaling_low_freq_factor),
               "high_freq_factor": float(args.rope_scaling_high_freq_factor),
               "original_max_position_embeddings":
                   int(args.rope_scaling_original_max_position_embeddings)}
    if min(scaling["factor"], scaling["low_freq_factor"],
           scaling["original_max_position_embeddings"]) <= 0:
        raise ValueError(f"--use-rope-scaling needs positive --rope-scaling-factor, "
                         f"--rope-scaling-low-freq-factor and "
                         f"--rope-scaling-original-max-position-embeddings (got {scaling})")
    if scaling["high_freq_factor"] < scaling["low_freq_factor"]:
        raise ValueError(f"--rope-scaling-high-freq-factor ({scaling['high_freq_factor']}) must be "
                         f"at least --rope-scaling-low-freq-factor ({scaling['low_freq_factor']})")
    return scaling


def build_model_config(args, padded_vocab_size: Optional[int] = None,
                       true_vocab_size: Optional[int] = None) -> ModelConfig:
    """The :class:`ModelConfig` of validated ``args``.

    Args:
        args: namespace after ``megatron.arguments.validate_args`` (or one restored from a
            checkpoint's ``args``).
        padded_vocab_size: rows of the embedding; default ``args.padded_vocab_size``.
        true_vocab_size: the tokenizer's vocabulary (the real rows); default
            ``args.true_vocab_size``, else None (every row real).

    Raises:
        ValueError: if the padded vocabulary size is unknown.
    """
    vocab = padded_vocab_size if padded_vocab_size is not None else getattr(
        args, "padded_vocab_size", None)
    if vocab is None:
        raise ValueError("the padded vocabulary size is unknown: build the tokenizer first and "
                         "pass it (megatron.tokenizer.vocab_size_with_padding)")
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None and getattr(args, "recompute_activations", False):
        granularity = "selective"  # Megatron: --recompute-activations = selective granularity
    if true_vocab_size is None:
        true_vocab_size = getattr(args, "true_vocab_size", None)
    return _from_args(ModelConfig, args, padded_vocab_size=vocab, true_vocab_size=true_vocab_size,
                      params_dtype=params_dtype_from_args(args),
                      recompute_granularity=granularity, rope_scaling=rope_scaling_from_args(args))


def build_training_config(args) -> TrainingConfig:
    """The :class:`TrainingConfig` of validated ``args`` (needs ``args.data_parallel_size``)."""
    from megatron.core.num_microbatches_calculator import num_microbatches, train_iterations

    rampup = getattr(args, "rampup_batch_size", None)
    rampup = None if rampup is None else tuple(int(x) for x in rampup)
    batches = dict(global_batch_size=args.global_batch_size,
                   micro_batch_size=args.micro_batch_size,
                   data_parallel_size=args.data_parallel_size)
    return _from_args(
        TrainingConfig, args, rampup_batch_size=rampup,
        num_microbatches=num_microbatches(**batches),
        num_iterations=train_iterations(getattr(args, "train_iters", None),
                                        getattr(args, "train_samples", None),
                                        rampup_batch_size=rampup, **batches))


def build_scheduler_config(args) -> SchedulerConfig:
    """The :class:`SchedulerConfig` of validated ``args``, its lengths in samples."""
    from megatron.core.optimizer.lr_scheduler import lr_schedule_steps

    warmup, decay, wd_incr = lr_schedule_steps(
        global_batch_size=args.global_batch_size, train_iters=getattr(args, "train_iters", None),
        train_samples=getattr(args, "train_samples", None),
        lr_decay_iters=getattr(args, "lr_decay_iters", None),
        lr_decay_samples=getattr(args, "lr_decay_samples", None),
        lr_warmup_iters=getattr(args, "lr_warmup_iters", 0),
        lr_warmup_samples=getattr(args, "lr_warmup_samples", 0),
        lr_warmup_fraction=getattr(args, "lr_warmup_fraction", None))
    return _from_args(SchedulerConfig, args, lr_warmup_steps=warmup, lr_decay_steps=decay,
                      wd_incr_steps=wd_incr)


def build_config(args, *, vocab_size: int, sections=()):
    """The :class:`~megatron.config.Config` of a run: validated ``args`` and the tokenizer's
    vocabulary size (padded here, once, to a multiple of ``--make-vocab-size-divisible-by`` x TP);
    ``sections``: the entry script's :class:`~megatron.config.ConfigSection` s (their flags
    parsed into ``args`` by ``parse_args(argv, extra_args_provider=...)``), in ``Config.extra``.

    Raises:
        ValueError: inconsistent values the sections refuse (e.g. TP x PP x DP != world size),
            or a registered section whose flags and fields disagree.
    """
    from megatron.config import Config
    from megatron.config.sections import build_sections
    from megatron.tokenizer import vocab_size_with_padding

    extra = build_sections(args, sections, builtin_dests()) if sections else {}
    padded = vocab_size_with_padding(vocab_size, args.make_vocab_size_divisible_by,
                                     args.tensor_model_parallel_size)
    paths = {name: _tuple(getattr(args, name, None))
             for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path")}
    config = Config(model=build_model_config(args, padded, vocab_size),
                    parallel=_from_args(ParallelConfig, args),
                    optimizer=_from_args(OptimizerConfig, args),
                    scheduler=build_scheduler_config(args),
                    training=build_training_config(args),
                    data=_from_args(DataConfig, args, **paths),
                    checkpoint=_from_args(CheckpointConfig, args),
                    logging=_from_args(LoggingConfig, args),
                    moe=build_moe_config(args))
    return config.with_extra(extra) if extra else config


def build_moe_config(args) -> MoEConfig:
    """The :class:`MoEConfig` of validated ``args``: ``moe_layer_freq`` is the per-layer 0/1
    tuple validation expanded (a dense model keeps the flag's value)."""
    freq = getattr(args, "moe_layer_freq", 1)
    return _from_args(MoEConfig, args,
                      moe_layer_freq=tuple(freq) if isinstance(freq, (list, tuple)) else freq)
