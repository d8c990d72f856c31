"""The logging section of the configuration: the log line, TensorBoard, W&B, MFU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoggingConfig:
    """What is logged, and where."""

    log_interval: int = 100
    """``--log-interval``: iterations between log lines. Default 100."""
    tensorboard_dir: Optional[str] = None
    """``--tensorboard-dir``: TensorBoard event folder. Default None (none written)."""
    tensorboard_queue_size: int = 1000
    """``--tensorboard-queue-size``: events buffered before a write. Default 1000."""
    peak_tflops: Optional[float] = None
    """``--peak-tflops``: peak TFLOP/s of one device (dense, training dtype) for the MFU of the log
    line. Default None (no MFU)."""
    measure_peak: bool = False
    """``--measure-peak``: measure that peak at start-up instead. Default off."""
    wandb_project: Optional[str] = None
    """``--wandb-project``: W&B project; set, the last rank logs the TensorBoard scalars to W&B.
    Default None (no W&B)."""
    wandb_exp_name: Optional[str] = None
    """``--wandb-exp-name``: the W&B run's name (needed with ``--wandb-project``). Default None."""
    wandb_save_dir: Optional[str] = None
    """``--wandb-save-dir``: folder of W&B's files. Default None (``{--save}/wandb``)."""
    job_name: Optional[str] = None
    """``--job-name``: only recorded in the checkpoints' args. Default None."""
