"""Frozen configuration built once from the parsed arguments and passed down explicitly.

Field names equal the argparse ``dest`` names of ``megatron/arguments.py``, so a grep leads from a
flag to the code that uses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

# One definition, owned by the optimizer package; re-exported here beside the other configs.
from megatron.core.optimizer.optimizer_config import OptimizerConfig  # noqa: F401


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a LLaMA model.

    Attributes:
        num_layers: transformer layers in the whole model (all pipeline stages).
        hidden_size: model width h.
        ffn_hidden_size: SwiGLU inner width (LLaMA-2 7B: 11008).
        num_attention_heads: query heads.
        num_query_groups: key/value heads (GQA); equals ``num_attention_heads`` for plain MHA.
        kv_channels: per-head width; ``hidden_size // num_attention_heads`` by default.
        padded_vocab_size: vocabulary rows of the embedding and output layer, already padded
            (``megatron.tokenizer.vocab_size_with_padding``).
        max_position_embeddings: longest sequence the rotary tables cover.
        norm_epsilon: RMSNorm epsilon.
        rotary_base: RoPE theta (10000; 500000 for Llama 3).
        rope_scaling: None, or a dict of Llama-3.1-style scaling ("factor", "low_freq_factor",
            "high_freq_factor", "original_max_position_embeddings").
        hidden_dropout / attention_dropout: dropout probabilities.
        init_method_std: std of the normal init; output projections use std / sqrt(2 * num_layers).
        untie_embeddings_and_output_weights: separate output layer (LLaMA) instead of tying it to
            the input embedding.
        add_bias_linear: biases on linear layers (False for LLaMA: ``--disable-bias-linear``).
        params_dtype: dtype of the model parameters (fp32, or bf16/fp16 for mixed precision).
        tensor_model_parallel_size: TP size the model is partitioned over.
        sequence_parallel: Megatron sequence parallelism (norms/dropout on ``[s/TP, b, h]``).
        recompute_granularity: None, ``"selective"`` (recompute the cheap, memory-heavy parts
            named by ``recompute_modules`` inside each layer) or ``"full"`` (recompute whole
            layers from their input); see :mod:`megatron.model.recompute`.
        recompute_method: with full granularity, ``"uniform"`` (checkpoint groups of
            ``recompute_num_layers`` layers) or ``"block"`` (checkpoint the first
            ``recompute_num_layers`` layers of each pipeline stage / model chunk).
        recompute_num_layers: layers per group (uniform) or recomputed layers per stage (block).
        recompute_modules: what selective recompute recomputes (``core_attn``, ``act``,
            ``layernorm``, ``mlp``).
        seed: base seed of the layout-independent weight initialisation.
        gradient_accumulation_fusion: weight gradients accumulate straight into the DDP
            ``main_grad`` buffers (``--no-gradient-accumulation-fusion`` turns it off; see
            :mod:`megatron.core.tensor_parallel.grad_accumulation`).
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    padded_vocab_size: int
    max_position_embeddings: int
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    rope_scaling: Optional[dict] = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = False
    params_dtype: torch.dtype = torch.float32
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[tuple] = None
    seed: int = 1234
    gradient_accumulation_fusion: bool = True

    def __post_init__(self):
        if self.recompute_modules is not None:
            object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def params_dtype_from_args(args) -> torch.dtype:
    """The model parameter dtype selected by ``--bf16`` / ``--fp16`` (fp32 otherwise)."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


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


@dataclass(frozen=True)
class ParallelConfig:
    """Process layout: ``world_size = TP x PP x DP`` (Megatron's rank order, see parallel_state).

    Attributes:
        distributed_timeout_minutes: collective timeout, fractions of a minute allowed.
        reduce_bucket_size: gradient bucket size in elements (None: one bucket per buffer).
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    distributed_backend: str = "gloo"
    distributed_timeout_minutes: float = 10.0
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    reduce_bucket_size: Optional[float] = None
    accumulate_allreduce_grads_in_fp32: bool = True

    def __post_init__(self):
        product = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                   * self.data_parallel_size)
        if product != self.world_size:
            raise ValueError(
                f"TP ({self.tensor_model_parallel_size}) x PP ({self.pipeline_model_parallel_size})"
                f" x DP ({self.data_parallel_size}) = {product} != world size ({self.world_size})")


@dataclass(frozen=True)
class TrainingConfig:
    """Batch sizes, length of the run, evaluation, logging and loss options.

    Attributes:
        micro_batch_size / global_batch_size: samples per micro-batch / per iteration.
        num_microbatches: micro-batches per iteration at the full global batch,
            ``global_batch_size // (micro_batch_size * data_parallel_size)``.
        train_iters / train_samples: length of the run (exactly one is set).
        exit_duration_in_mins: wall-clock limit in minutes (fractions allowed).
    """

    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    seq_length: int
    data_parallel_size: int = 1
    rampup_batch_size: Optional[tuple] = None
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    eval_interval: int = 1000
    eval_iters: int = 100
    log_interval: int = 100
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    calculate_per_token_loss: bool = False
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    tensorboard_dir: Optional[str] = None
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_batch_size_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False


@dataclass(frozen=True)
class DataConfig:
    """Datasets and loading. ``--data-path`` blends and ``--split`` are parsed by
    ``megatron.data.blend_config`` (``split_sources``), for validation and the builder alike."""

    seq_length: int
    data_path: Optional[list] = None
    train_data_path: Optional[list] = None
    valid_data_path: Optional[list] = None
    test_data_path: Optional[list] = None
    split: str = "969, 30, 1"
    data_cache_path: Optional[str] = None
    dataloader_type: str = "single"
    num_workers: int = 2
    seed: int = 1234
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    """Megatron's legacy checkpoint layout (``--ckpt-format torch``) and what to save/load."""

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    use_checkpoint_args: bool = False
    ckpt_format: str = "torch"
    keep_last_checkpoints: Optional[int] = None


@dataclass(frozen=True)
class Configs:
    """Every configuration of a run, built once by :func:`configs_from_args`."""

    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    data: DataConfig
    checkpoint: CheckpointConfig


def build_model_config(args, padded_vocab_size: Optional[int] = None) -> ModelConfig:
    """The :class:`ModelConfig` of validated ``args``.

    Args:
        args: namespace after ``megatron.arguments.validate_args``.
        padded_vocab_size: rows of the embedding; default ``args.padded_vocab_size`` (set once
            the tokenizer is built, see ``megatron.tokenizer.vocab_size_with_padding``).

    Raises:
        ValueError: if the padded vocabulary size is unknown.
    """
    vocab = padded_vocab_size if padded_vocab_size is not None else getattr(
        args, "padded_vocab_size", None)
    if vocab is None:
        raise ValueError("the padded vocabulary size is unknown: build the tokenizer first and "
                         "set args.padded_vocab_size (megatron.tokenizer.vocab_size_with_padding)")
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None and getattr(args, "recompute_activations", False):
        granularity = "selective"  # Megatron: --recompute-activations = selective granularity
    return _from_args(ModelConfig, args, padded_vocab_size=vocab, params_dtype=params_dtype_from_args(args),
                      recompute_granularity=granularity, rope_scaling=rope_scaling_from_args(args))


def rope_scaling_from_args(args) -> Optional[dict]:
    """``ModelConfig.rope_scaling`` from Megatron-LM's ``--use-rope-scaling`` and
    ``--rope-scaling-*`` flags: HuggingFace's Llama-3.1 dict (``rope_type: llama3``), or None.

    A namespace without the flags (made by hand) may carry the dict as ``args.rope_scaling``.

    Raises:
        ValueError: a non-positive factor or ``--rope-scaling-high-freq-factor`` not above the
            low one (the interpolation would divide by zero).
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
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"--rope-scaling-high-freq-factor ({scaling['high_freq_factor']}) must be "
                         f"above --rope-scaling-low-freq-factor ({scaling['low_freq_factor']})")
    return scaling


def build_training_config(args) -> TrainingConfig:
    """The :class:`TrainingConfig` of validated ``args`` (needs ``args.data_parallel_size``)."""
    per_step = args.micro_batch_size * args.data_parallel_size
    rampup = getattr(args, "rampup_batch_size", None)
    return _from_args(TrainingConfig, args, num_microbatches=args.global_batch_size // per_step,
                      rampup_batch_size=None if rampup is None else tuple(int(x) for x in rampup))


def build_optimizer_config(args) -> OptimizerConfig:
    """The :class:`OptimizerConfig` of validated ``args``."""
    return _from_args(OptimizerConfig, args)


def configs_from_args(args, padded_vocab_size: Optional[int] = None) -> Configs:
    """Every configuration of validated ``args``; see :func:`build_model_config` for the vocab."""
    return Configs(model=build_model_config(args, padded_vocab_size),
                   parallel=_from_args(ParallelConfig, args),
                   training=build_training_config(args),
                   optimizer=build_optimizer_config(args),
                   data=_from_args(DataConfig, args),
                   checkpoint=_from_args(CheckpointConfig, args))
