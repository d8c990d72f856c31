"""Number of micro-batches per iteration, constant or with a batch-size ramp-up.

Megatron-LM's ``megatron/core/num_microbatches_calculator.py`` arithmetic: an iteration of global
batch ``B`` runs ``B // (micro_batch_size * data_parallel_size)`` micro-batches on every
data-parallel rank. With ``--rampup-batch-size START INCR SAMPLES`` the global batch starts at
START and grows by INCR every ``SAMPLES / ((GLOBAL - START) / INCR)`` consumed samples, reaching
the full ``--global-batch-size`` once more than SAMPLES samples are consumed.

The calculator is an object the training loop holds, not a global. :func:`num_microbatches` is
the one definition of the count (validation, the configuration and the calculators use it).
"""

from __future__ import annotations

from typing import Optional, Sequence


def num_microbatches(global_batch_size: int, micro_batch_size: int,
                     data_parallel_size: int) -> int:
    """Micro-batches per iteration on every data-parallel rank:
    ``global_batch_size // (micro_batch_size * data_parallel_size)``.

    Raises:
        ValueError: if the global batch is not a positive multiple of micro-batch x DP.
    """
    per_step = micro_batch_size * data_parallel_size
    if per_step <= 0 or global_batch_size <= 0 or global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size ({global_batch_size}) must be a positive multiple of "
            f"--micro-batch-size ({micro_batch_size}) x data-parallel size "
            f"({data_parallel_size}) = {per_step}")
    return global_batch_size // per_step


class ConstantNumMicroBatches:
    """Fixed global batch: ``global_batch_size // (micro_batch_size * data_parallel_size)``.

    Raises:
        ValueError: if the global batch is not a positive multiple of micro-batch x DP.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int):
        self.num_micro_batches = num_microbatches(global_batch_size, micro_batch_size,
                                                  data_parallel_size)
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.current_global_batch_size = global_batch_size

    def get(self) -> int:
        """Micro-batches of the current iteration."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """Samples of the current iteration."""
        return self.current_global_batch_size

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        """Nothing changes with a constant batch."""


class RampupBatchsizeNumMicroBatches(ConstantNumMicroBatches):
    """Global batch ramped up linearly in steps of ``batch_size_increment`` (Megatron's rule).

    Args:
        start_batch_size: global batch at 0 consumed samples.
        batch_size_increment: growth per step; ``global - start`` must be a multiple of it.
        rampup_samples: consumed samples over which the batch grows to ``global_batch_size``.
        global_batch_size / micro_batch_size / data_parallel_size: as for the constant case.

    Raises:
        ValueError: for non-positive sizes, a start above the global batch, or a difference
            that is not a multiple of the increment.
    """

    def __init__(self, start_batch_size: int, batch_size_increment: int, rampup_samples: int,
                 global_batch_size: int, micro_batch_size: int, data_parallel_size: int):
        super().__init__(global_batch_size, micro_batch_size, data_parallel_size)
        if start_batch_size <= 0 or batch_size_increment <= 0 or rampup_samples < 0:
            raise ValueError(f"--rampup-batch-size ({start_batch_size} {batch_size_increment} "
                             f"{rampup_samples}) needs START > 0, INCR > 0 and SAMPLES >= 0")
        diff = global_batch_size - start_batch_size
        if diff < 0 or diff % batch_size_increment:
            raise ValueError(f"--global-batch-size ({global_batch_size}) minus the ramp-up start "
                             f"({start_batch_size}) must be a non-negative multiple of the "
                             f"increment ({batch_size_increment})")
        self.global_batch_size = global_batch_size
        self.start_batch_size = start_batch_size
        self.batch_size_increment = batch_size_increment
        self.rampup_samples = rampup_samples
        num_increments = diff // batch_size_increment
        # Megatron divides by zero when start == global; there is simply no ramp-up then.
        self.rampup_samples_per_increment = (rampup_samples / num_increments
                                             if num_increments else float("inf"))
        self.update(0, False)

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        """Set the global batch and micro-batch count for ``consumed_samples``.

        Raises:
            ValueError: with ``consistency_check``, if the current global batch is not a
                multiple of micro-batch x DP.
        """
        if consumed_samples > self.rampup_samples:
            self.current_global_batch_size = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            self.current_global_batch_size = (self.start_batch_size
                                              + steps * self.batch_size_increment)
        per_step = self.micro_batch_size * self.data_parallel_size
        if consistency_check and self.current_global_batch_size % per_step:
            raise ValueError(f"ramped-up global batch size ({self.current_global_batch_size}) "
                             f"is not divisible by micro-batch size ({self.micro_batch_size}) x "
                             f"data-parallel size ({self.data_parallel_size}); choose "
                             f"--rampup-batch-size values that are multiples of {per_step}")
        self.num_micro_batches = self.current_global_batch_size // per_step


def build_num_microbatches_calculator(global_batch_size: int, micro_batch_size: int,
                                      data_parallel_size: int,
                                      rampup_batch_size: Optional[Sequence] = None
                                      ) -> ConstantNumMicroBatches:
    """The calculator of a constant global batch, or of ``--rampup-batch-size START INCR
    SAMPLES``.

    Raises:
        ValueError: a ramp-up that is not three values, or sizes the calculators refuse.
    """
    if rampup_batch_size is None:
        return ConstantNumMicroBatches(global_batch_size, micro_batch_size, data_parallel_size)
    if len(rampup_batch_size) != 3:
        raise ValueError(f"--rampup-batch-size ({' '.join(map(str, rampup_batch_size))}) takes "
                         f"three values: START INCR SAMPLES")
    start, incr, samples = (int(x) for x in rampup_batch_size)
    return RampupBatchsizeNumMicroBatches(start, incr, samples, global_batch_size,
                                          micro_batch_size, data_parallel_size)


def train_iterations(train_iters: Optional[int], train_samples: Optional[int], *,
                     global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                     rampup_batch_size: Optional[Sequence] = None) -> int:
    """Iterations of the run (Megatron-LM's ``update_train_iters``): ``train_iters``, or with
    ``train_samples`` the iterations of the ramp-up (while at most SAMPLES samples are consumed,
    each iteration taking the ramped global batch) plus the remaining samples in whole global
    batches (a partial last batch is dropped)."""
    if train_iters:
        return train_iters
    if rampup_batch_size is None:
        return train_samples // global_batch_size
    calculator = build_num_microbatches_calculator(global_batch_size, micro_batch_size,
                                                   data_parallel_size, rampup_batch_size)
    iterations = consumed = 0
    while consumed <= int(rampup_batch_size[2]) and consumed <= train_samples:
        calculator.update(consumed, False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch_size
    return iterations
