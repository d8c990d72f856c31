"""The range of every number a flag takes, checked before any other rule reads it.

One table, :data:`RANGES`, gives every ``int`` and ``float`` flag of ``megatron.arguments`` its
interval and what the number is; :func:`check_ranges` refuses a value outside it, and every NaN or
infinity, with one line naming the flag, the value, the interval and a valid example (the
default where it is one). ``tests/unit/test_arguments_ranges.py`` checks that every numeric flag
of the parser has an entry, so a new flag cannot skip the check.

Without these, ``--lr nan`` trained NaN from the first step, ``--clip-grad nan`` clipped nothing
(``nan`` compares false), ``--seed -1`` failed deep inside NumPy, ``--adam-beta1 1.5`` made the
moments grow without bound and ``--init-method-std -1`` was taken as 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron.usage_error import UsageError

INF = math.inf
# np.random.seed takes [0, 2**32 - 1]; the pipeline stage adds 100 per stage to --seed.
MAX_SEED = 2 ** 32 - 1


@dataclass(frozen=True)
class Range:
    """An interval of a flag's values.

    Attributes:
        low / high: the bounds (``-inf`` / ``inf`` for none).
        low_open / high_open: whether the bound itself is excluded.
        what: what the number is, for the message.
        whole: a float flag that must hold a whole number (``--loss-scale-window 1e3``).
    """

    low: float
    high: float
    what: str
    low_open: bool = False
    high_open: bool = True
    whole: bool = False

    def contains(self, value) -> bool:
        if not math.isfinite(value):
            return False
        if self.whole and value != int(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self, value) -> str:
        if self.high == INF:
            integer = isinstance(value, int) and not self.low_open
            if (self.low == 0 and self.low_open) or (self.low == 1 and integer):
                return "must be positive"
            return f"must be {'>' if self.low_open else '>='} {_bound(self.low)}"
        return (f"must be in {'(' if self.low_open else '['}{_bound(self.low)}, "
                f"{_bound(self.high)}{')' if self.high_open else ']'}")


def _bound(x: float) -> str:
    """A bound as users type it: whole numbers in full (``4294967295``, not ``4.29497e+09``)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _positive(what):
    return Range(1, INF, what)


def _at_least_0(what):
    return Range(0, INF, what)


def _above_0(what):
    return Range(0, INF, what, low_open=True)


RANGES = {
    # network size
    "num_layers": _positive("transformer layers"),
    "hidden_size": _positive("the hidden width"),
    "ffn_hidden_size": _positive("the MLP's inner width"),
    "num_attention_heads": _positive("query heads"),
    "num_query_groups": _positive("key/value heads"),
    "kv_channels": _positive("the per-head width"),
    "max_position_embeddings": _positive("the longest sequence, in tokens"),
    "norm_epsilon": _above_0("RMSNorm's epsilon"),
    "rotary_base": _above_0("RoPE's theta"),
    "rope_scaling_factor": _above_0("Llama 3.1's RoPE scaling factor"),
    "rope_scaling_low_freq_factor": _above_0("Llama 3.1's low_freq_factor"),
    "rope_scaling_high_freq_factor": _above_0("Llama 3.1's high_freq_factor"),
    "rope_scaling_original_max_position_embeddings": _positive("the context before scaling"),
    "attention_chunk_size": _positive("tokens per attention chunk"),
    "attn_temperature_floor_scale": _above_0("Llama 4's floor_scale, in tokens"),
    "attn_temperature_scale": _at_least_0("Llama 4's attn_scale"),
    "init_method_std": _above_0("the standard deviation of the initial weights"),
    "make_vocab_size_divisible_by": _positive("the vocabulary padding multiple"),
    "vocab_size": _positive("the NullTokenizer's vocabulary"),
    # regularization and optimizer
    "hidden_dropout": Range(0, 1, "a dropout probability"),
    "attention_dropout": Range(0, 1, "a dropout probability"),
    "weight_decay": _at_least_0("AdamW's decoupled weight decay"),
    "clip_grad": _at_least_0("the global gradient-norm clip (0 = off)"),
    "adam_beta1": Range(0, 1, "Adam's first-moment decay rate"),
    "adam_beta2": Range(0, 1, "Adam's second-moment decay rate"),
    "adam_eps": _above_0("Adam's denominator epsilon (0 divides by zero on a zero gradient)"),
    # training
    "micro_batch_size": _positive("samples per micro-batch"),
    "global_batch_size": _positive("samples per iteration"),
    "train_iters": _positive("iterations"),
    "train_samples": _positive("samples"),
    "exit_interval": _positive("iterations"),
    "exit_duration_in_mins": _above_0("minutes"),
    "seed": Range(0, MAX_SEED, "a seed (NumPy's range)", high_open=False),
    "recompute_num_layers": _positive("layers"),
    # learning rate
    "lr": _at_least_0("the peak learning rate"),
    "min_lr": _at_least_0("the final learning rate"),
    "lr_decay_iters": _positive("iterations"),
    "lr_decay_samples": _positive("samples"),
    "lr_warmup_iters": _at_least_0("iterations"),
    "lr_warmup_fraction": Range(0, 1, "a fraction of the decay length", high_open=False),
    "optimizer_offload_fraction": Range(0, 1, "a share of the optimizer state", high_open=False),
    "lr_warmup_samples": _at_least_0("samples"),
    # mixed precision
    "loss_scale": _above_0("the constant fp16 loss scale"),
    "initial_loss_scale": _above_0("the first dynamic fp16 loss scale"),
    "min_loss_scale": _above_0("the lowest dynamic fp16 loss scale"),
    "loss_scale_window": Range(1, INF, "clean iterations before the loss scale grows",
                               whole=True),
    "hysteresis": _positive("overflows tolerated before the loss scale backs off"),
    "max_consecutive_nan_iterations": _at_least_0("iterations (0 = never stop)"),
    # distributed
    "tensor_model_parallel_size": _positive("ranks"),
    "pipeline_model_parallel_size": _positive("ranks"),
    "context_parallel_size": _positive("ranks"),
    "expert_model_parallel_size": _positive("ranks"),
    "expert_tensor_parallel_size": _positive("ranks"),
    "num_layers_per_virtual_pipeline_stage": _positive("layers"),
    "virtual_pipeline_model_parallel_size": _positive("model chunks per pipeline rank"),
    "distributed_timeout_minutes": _above_0("minutes"),
    "reduce_bucket_size": Range(1, INF, "elements per gradient bucket"),
    "local_rank": _at_least_0("the process's index on its node"),
    # checkpointing
    "save_interval": _positive("iterations"),
    "keep_last_checkpoints": _positive("checkpoints"),
    # data
    "seq_length": _positive("tokens per sample"),
    "num_workers": _at_least_0("data-loader worker processes"),
    # logging and evaluation
    "log_interval": _positive("iterations"),
    "peak_tflops": _above_0("TFLOP/s of one device"),
    "eval_interval": _positive("iterations"),
    "eval_iters": _at_least_0("iterations (0 = no evaluation)"),
    "tensorboard_queue_size": _positive("events"),
    # mixture of experts
    "num_experts": _positive("routed experts per MoE layer"),
    "moe_ffn_hidden_size": _positive("each expert's inner width"),
    "moe_router_topk": _positive("experts per token"),
    "moe_router_topk_scaling_factor": _above_0("the top-k probabilities' factor"),
    "moe_router_num_groups": _positive("expert groups"),
    "moe_router_group_topk": _positive("groups per token"),
    "moe_router_bias_update_rate": _at_least_0("the expert bias step"),
    "moe_aux_loss_coeff": _at_least_0("the load-balancing loss weight"),
    "moe_z_loss_coeff": _at_least_0("the z-loss weight"),
    "moe_expert_capacity_factor": _above_0("the expert capacity factor"),
    "moe_shared_expert_intermediate_size": _positive("the shared expert's width"),
}


def flag_of(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _example(dest: str, rule: Range, defaults: dict) -> Optional[str]:
    default = defaults.get(dest)
    if isinstance(default, (int, float)) and not isinstance(default, bool) and \
            rule.contains(default):
        return f"e.g. {default:g} (the default)"
    return None


def check_ranges(args, defaults: dict) -> None:
    """Refuse a NaN, an infinity or a value outside :data:`RANGES` in any flag of ``args``
    (flags left unset, None, are not checked). ``--seed`` must also leave room for the offset of
    100 per pipeline stage.

    Args:
        defaults: the parser's default of every ``dest`` (for the example in the message).

    Raises:
        UsageError: ``--adam-beta1 (1.5) must be in [0, 1): Adam's first-moment decay rate; e.g.
            0.9 (the default)``.
    """
    for dest, rule in RANGES.items():
        value = getattr(args, dest, None)
        if value is None or isinstance(value, bool):
            continue
        if not rule.contains(value):
            finite = "" if math.isfinite(value) else "must be a finite number and "
            example = _example(dest, rule, defaults)
            raise UsageError(f"{flag_of(dest)} ({value}) {finite}{rule.describe(value)}"
                             + (" and a whole number" if rule.whole else "")
                             + f": {rule.what}" + (f"; {example}" if example else ""))
    stages = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if args.seed + 100 * (stages - 1) > MAX_SEED:
        raise UsageError(f"--seed ({args.seed}) must be at most {MAX_SEED - 100 * (stages - 1)} "
                         f"with --pipeline-model-parallel-size {stages}: each stage seeds with "
                         f"--seed + 100 x its rank, and NumPy takes seeds up to {MAX_SEED}")
