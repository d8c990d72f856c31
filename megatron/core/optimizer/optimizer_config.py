"""The optimizer's configuration (Megatron-Core's ``megatron/core/optimizer/optimizer_config.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer settings; field names are Megatron's ``args`` names (``--adam-beta1`` ->
    ``adam_beta1``), so ``megatron.config`` fills it from the parsed flags.

    Attributes:
        optimizer: ``--optimizer``: only ``"adam"`` (AdamW with decoupled weight decay, as
            Megatron's Adam). Default ``adam``.
        lr: ``--lr``: peak learning rate (the scheduler sets the lr every step). Required.
        min_lr: ``--min-lr``: final learning rate of the decay. Default 0.
        weight_decay: ``--weight-decay``: decoupled L2 coefficient for parameters with 2+ dims
            (none on norms, biases). Default 0.01.
        adam_beta1 / adam_beta2 / adam_eps: ``--adam-beta1`` (0.9), ``--adam-beta2`` (0.999),
            ``--adam-eps`` (1e-8): Adam coefficients.
        clip_grad: ``--clip-grad``: global L2 norm to clip to; 0 disables clipping (and the norm
            computation). Default 1.0.
        bf16 / fp16: ``--bf16`` / ``--fp16``: model parameters in bf16/fp16 with fp32 main
            params. Default off.
        loss_scale: ``--loss-scale``: constant fp16 loss scale; None for the dynamic scaler.
        initial_loss_scale: ``--initial-loss-scale``: first dynamic scale (2**32).
        min_loss_scale: ``--min-loss-scale``: floor of the dynamic scale (1).
        loss_scale_window: ``--loss-scale-window``: iterations without overflow before the
            scale doubles (1000).
        hysteresis: ``--hysteresis``: overflows tolerated before the scale halves (2).
        use_distributed_optimizer: ``--use-distributed-optimizer``: shard the main params and
            Adam moments over data parallelism (``DistributedOptimizer``). Default off.
        log_num_zeros_in_grad: ``--log-num-zeros-in-grad``: count zero gradient elements each
            step. Default off.

    Raises:
        ValueError: for another ``--optimizer``, a missing or negative ``--lr``, a negative
            ``--clip-grad``, or ``--bf16`` with ``--fp16``.
    """

    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False
    log_num_zeros_in_grad: bool = False

    def __post_init__(self):
        if self.optimizer != "adam":
            raise ValueError(f"--optimizer {self.optimizer} is not supported yet; use --optimizer adam")
        if self.lr is None or self.lr < 0:
            raise ValueError(f"--lr ({self.lr}) must be given and >= 0")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad ({self.clip_grad}) must be >= 0 (0 disables clipping)")
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are mutually exclusive; choose one")
