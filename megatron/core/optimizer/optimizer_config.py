"""The optimizer's and the learning-rate schedule's configuration (Megatron-Core's
``megatron/core/optimizer/optimizer_config.py``; the schedule's, Megatron-LM's ``--lr-*`` flags).

Field names are Megatron's ``args`` names (``--adam-beta1`` -> ``adam_beta1``); each field's
docstring gives its flag, unit and default. ``megatron.config`` builds both from the parsed flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer settings.

    Raises:
        ValueError: for another ``--optimizer``, a missing or negative ``--lr``, a negative
            ``--clip-grad``, or ``--bf16`` with ``--fp16``.
    """

    optimizer: str = "adam"
    """``--optimizer``: only ``adam`` (AdamW with decoupled weight decay, as Megatron's Adam), the
    default."""
    lr: Optional[float] = None
    """``--lr``: peak learning rate (the scheduler sets the lr every step). Required."""
    min_lr: float = 0.0
    """``--min-lr``: final learning rate of the decay. Default 0."""
    weight_decay: float = 0.01
    """``--weight-decay``: decoupled L2 coefficient of parameters with 2+ dims (none on norms
    and biases). Default 0.01."""
    adam_beta1: float = 0.9
    """``--adam-beta1``: Adam's first-moment coefficient. Default 0.9."""
    adam_beta2: float = 0.999
    """``--adam-beta2``: Adam's second-moment coefficient. Default 0.999."""
    adam_eps: float = 1e-8
    """``--adam-eps``: Adam's epsilon. Default 1e-8."""
    clip_grad: float = 1.0
    """``--clip-grad``: global L2 norm to clip the gradients to; 0 disables clipping (and the
    norm). Default 1.0."""
    bf16: bool = False
    """``--bf16``: bf16 model parameters with fp32 main params. Default off."""
    fp16: bool = False
    """``--fp16``: fp16 model parameters with fp32 main params and loss scaling. Default off."""
    loss_scale: Optional[float] = None
    """``--loss-scale``: constant fp16 loss scale; None (the default) for the dynamic scaler."""
    initial_loss_scale: float = 2.0 ** 32
    """``--initial-loss-scale``: first dynamic fp16 loss scale. Default 2**32."""
    min_loss_scale: float = 1.0
    """``--min-loss-scale``: floor of the dynamic loss scale. Default 1."""
    loss_scale_window: float = 1000
    """``--loss-scale-window``: iterations without overflow before the scale doubles. Default
    1000."""
    hysteresis: int = 2
    """``--hysteresis``: overflows tolerated before the scale halves. Default 2."""
    use_distributed_optimizer: bool = False
    """``--use-distributed-optimizer`` (implied by ``--overlapped-distributed-optimizer``): shard
    the main params and Adam moments over data parallelism. Default off."""
    optimizer_cpu_offload: bool = False
    """``--optimizer-cpu-offload``: the distributed optimizer keeps its fp32 main params and Adam
    moments in host memory (pinned on CUDA) and steps there. Default off."""
    optimizer_offload_fraction: float = 1.0
    """``--optimizer-offload-fraction``: share of the state offloaded; only 1.0 (validation
    refuses others). Default 1.0."""
    log_num_zeros_in_grad: bool = False
    """``--log-num-zeros-in-grad``: count the zero gradient elements every step. Default off."""

    def __post_init__(self):
        if self.optimizer != "adam":
            raise ValueError(f"--optimizer {self.optimizer} is not supported yet; use --optimizer adam")
        if self.lr is None or self.lr < 0:
            raise ValueError(f"--lr ({self.lr}) must be given and >= 0")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad ({self.clip_grad}) must be >= 0 (0 disables clipping)")
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are mutually exclusive; choose one")


@dataclass(frozen=True)
class SchedulerConfig:
    """The learning-rate (and weight-decay) schedule. As in Megatron-LM every length is in
    samples: the training loop steps the scheduler by the global batch every iteration, and
    iteration-based flags are multiplied by ``--global-batch-size``
    (:func:`~megatron.core.optimizer.lr_scheduler.lr_schedule_steps`)."""

    lr_decay_style: str = "linear"
    """``--lr-decay-style``: constant, linear, cosine or inverse-square-root. Default linear."""
    lr_decay_iters: Optional[int] = None
    """``--lr-decay-iters``: iterations of the decay; default ``--train-iters`` (filled by
    validation)."""
    lr_decay_samples: Optional[int] = None
    """``--lr-decay-samples``: samples of the decay; default ``--train-samples``."""
    lr_warmup_iters: int = 0
    """``--lr-warmup-iters``: iterations of linear warmup. Default 0."""
    lr_warmup_samples: int = 0
    """``--lr-warmup-samples``: samples of linear warmup. Default 0."""
    lr_warmup_fraction: Optional[float] = None
    """``--lr-warmup-fraction``: warmup as a fraction of the decay length; None (the default)
    uses the iterations or samples."""
    override_opt_param_scheduler: bool = False
    """``--override-opt_param-scheduler``: take the schedule from the flags, not from the
    checkpoint. Default off."""
    use_checkpoint_opt_param_scheduler: bool = False
    """``--use-checkpoint-opt_param-scheduler``: take the schedule from the checkpoint. Default
    off."""
    lr_warmup_steps: float = 0
    """Derived: warmup length in samples (a fraction of the decay with
    ``--lr-warmup-fraction``)."""
    lr_decay_steps: int = 0
    """Derived: decay length in samples."""
    wd_incr_steps: int = 0
    """Derived: length of the weight-decay schedule in samples (the training length)."""
