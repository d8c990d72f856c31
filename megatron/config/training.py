"""The training section of the configuration: batches, length of the run, evaluation, stopping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TrainingConfig:
    """Batch sizes, length of the run, evaluation and stopping, loss normalisation."""

    micro_batch_size: int
    """``--micro-batch-size``: samples per micro-batch on one data-parallel rank. Required."""
    global_batch_size: int
    """``--global-batch-size``: samples per iteration over all data-parallel ranks; flag default
    micro-batch x DP."""
    num_microbatches: int
    """Derived: micro-batches per iteration at the full global batch,
    ``global_batch_size // (micro_batch_size x DP)``
    (:func:`megatron.core.num_microbatches_calculator.num_microbatches`)."""
    num_iterations: int
    """Derived: iterations of the run, ``--train-iters``, or with ``--train-samples`` those of
    the ramp-up plus the remaining samples in whole global batches
    (:func:`megatron.core.num_microbatches_calculator.train_iterations`)."""
    rampup_batch_size: Optional[tuple] = None
    """``--rampup-batch-size START INCR SAMPLES``: global batch ramp-up (three ints), None (the
    default) for a constant batch."""
    train_iters: Optional[int] = None
    """``--train-iters``: length of the run in iterations; default None (exactly one of this and
    ``train_samples`` is required)."""
    train_samples: Optional[int] = None
    """``--train-samples``: length of the run in samples; default None."""
    eval_interval: int = 1000
    """``--eval-interval``: iterations between evaluations. Default 1000."""
    eval_iters: int = 100
    """``--eval-iters``: iterations (global batches) of one evaluation; 0 = none. Default 100."""
    exit_interval: Optional[int] = None
    """``--exit-interval``: stop after the iteration that is a multiple of this. Default None."""
    exit_duration_in_mins: Optional[float] = None
    """``--exit-duration-in-mins``: wall-clock budget in minutes (fractions allowed), with a
    checkpoint at the end. Default None."""
    exit_signal_handler: bool = False
    """``--exit-signal-handler``: on SIGTERM finish the iteration, save and exit. Default off."""
    seed: int = 1234
    """``--seed``: base seed of the RNGs of training (offset per pipeline stage). Default 1234."""
    calculate_per_token_loss: bool = False
    """``--calculate-per-token-loss``: normalise the loss by the unmasked tokens of the global
    batch. Default off."""
    max_consecutive_nan_iterations: int = 3
    """``--max-consecutive-nan-iterations``: stop after this many skipped inf/NaN iterations in a
    row; 0 = never. Default 3."""
    compile: bool = False
    """``--compile``: ``torch.compile`` each transformer layer. Default off."""
