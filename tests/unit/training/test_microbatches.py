"""Micro-batch calculators: Megatron-LM's arithmetic, values worked out by hand."""

import pytest

from megatron.core.num_microbatches_calculator import (ConstantNumMicroBatches,
                                            RampupBatchsizeNumMicroBatches,
                                            build_num_microbatches_calculator, num_microbatches,
                                            train_iterations)


@pytest.mark.parametrize("gbs, mbs, dp, expected", [(8, 2, 2, 2), (8, 2, 1, 4), (1024, 1, 8, 128),
                                                    (4, 4, 1, 1)])
def test_constant(gbs, mbs, dp, expected):
    calc = ConstantNumMicroBatches(gbs, mbs, dp)
    calc.update(10 ** 6, True)
    assert calc.get() == expected and calc.get_current_global_batch_size() == gbs


@pytest.mark.parametrize("gbs, mbs, dp", [(6, 2, 2), (2, 2, 2), (0, 1, 1)])
def test_constant_rejects_indivisible(gbs, mbs, dp):
    with pytest.raises(ValueError, match=rf"--global-batch-size \({gbs}\) must be a positive "
                                         rf"multiple of --micro-batch-size \({mbs}\)"):
        ConstantNumMicroBatches(gbs, mbs, dp)


# start 16, +16 per step over 300 samples, to 64: 3 increments, one every 100 samples.
@pytest.mark.parametrize("consumed, gbs", [(0, 16), (99, 16), (100, 32), (199, 32), (200, 48),
                                           (299, 48), (300, 64), (301, 64), (10 ** 6, 64)])
def test_rampup_steps(consumed, gbs):
    calc = RampupBatchsizeNumMicroBatches(16, 16, 300, 64, micro_batch_size=2,
                                          data_parallel_size=2)
    calc.update(consumed, True)
    assert calc.get_current_global_batch_size() == gbs
    assert calc.get() == gbs // 4


def test_rampup_fractional_samples_per_increment():
    # 1000 samples / 3 increments = 333.33...: int(consumed / 333.33) steps, as Megatron.
    calc = RampupBatchsizeNumMicroBatches(32, 32, 1000, 128, 1, 1)
    seen = {}
    for consumed in (333, 334, 666, 667, 999, 1000, 1001):
        calc.update(consumed, False)
        seen[consumed] = calc.get_current_global_batch_size()
    assert seen == {333: 32, 334: 64, 666: 64, 667: 96, 999: 96, 1000: 128, 1001: 128}


def test_rampup_training_loop_sequence():
    # Megatron's loop: update(consumed, True) before each iteration, consumed += current batch.
    calc = build_num_microbatches_calculator(32, 4, 2, rampup_batch_size=["8", "8", "64"])
    consumed, batches = 0, []
    for _ in range(10):
        calc.update(consumed, True)
        batches.append((calc.get_current_global_batch_size(), calc.get()))
        consumed += calc.get_current_global_batch_size()
    # +8 every 64 / 3 = 21.33 samples; consumed 0, 8, 16 -> 8; 24, 40 -> 16; 56 -> 24; 80 -> 32
    assert batches == [(8, 1), (8, 1), (8, 1), (16, 2), (16, 2), (24, 3), (32, 4), (32, 4),
                       (32, 4), (32, 4)]


def test_rampup_without_increments_is_constant():
    calc = RampupBatchsizeNumMicroBatches(16, 16, 100, 16, 2, 2)
    calc.update(50, True)
    assert (calc.get_current_global_batch_size(), calc.get()) == (16, 4)


def test_rampup_errors():
    with pytest.raises(ValueError, match=r"minus the ramp-up start \(16\) must be a non-negative "
                                         r"multiple of the increment \(10\)"):
        RampupBatchsizeNumMicroBatches(16, 10, 100, 64, 1, 1)
    with pytest.raises(ValueError, match=r"minus the ramp-up start \(128\)"):
        RampupBatchsizeNumMicroBatches(128, 16, 100, 64, 1, 1)
    calc = RampupBatchsizeNumMicroBatches(6, 6, 100, 24, 4, 1)  # 6 is not a multiple of 4
    with pytest.raises(ValueError, match=r"ramped-up global batch size \(6\) is not divisible"):
        calc.update(0, True)
    with pytest.raises(ValueError, match="takes three values"):
        build_num_microbatches_calculator(8, 1, 1, rampup_batch_size=[1, 2])


def test_builder_constant():
    calc = build_num_microbatches_calculator(64, 2, 4)
    assert isinstance(calc, ConstantNumMicroBatches) and calc.get() == 8


def test_the_one_micro_batch_count_and_the_length_of_a_run():
    assert num_microbatches(64, 2, 4) == 8
    with pytest.raises(ValueError, match=r"--global-batch-size \(10\) must be a positive multiple"):
        num_microbatches(10, 2, 2)
    batches = dict(global_batch_size=32, micro_batch_size=4, data_parallel_size=2)
    assert train_iterations(10, None, **batches) == 10
    assert train_iterations(None, 100, **batches) == 3  # a partial last batch is dropped
    # Ramp-up 8 8 64: batches 8, 8, 8, 16, 16, 24 consume 80 samples (> 64), then 120 // 32 = 3.
    assert train_iterations(None, 200, rampup_batch_size=(8, 8, 64), **batches) == 9
