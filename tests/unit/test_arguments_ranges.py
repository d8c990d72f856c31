"""megatron.arguments.ranges: every int/float flag has a range; NaN, infinity and out-of-range
values are refused before any other rule reads them, naming the flag, the value and the fix."""

import math
import re

import pytest

from megatron.arguments import build_parser, parse_args, parser_defaults, validate_args
from megatron.arguments.ranges import RANGES, Range, flag_of
from megatron.usage_error import UsageError

ARGV = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
        "--micro-batch-size 2 --lr 2e-3 --train-iters 10 --tokenizer-type NullTokenizer "
        "--vocab-size 100 --data-path nowhere").split()


def _validate(*extra):
    return validate_args(parse_args(ARGV + [str(e) for e in extra]), 4, check_files=False)


def test_every_numeric_flag_has_a_range():
    numeric = {a.dest for a in build_parser()._actions if a.type in (int, float)}
    assert numeric == set(RANGES)


def test_every_default_lies_in_its_range():
    defaults = parser_defaults()
    for dest, rule in RANGES.items():
        value = defaults.get(dest)
        if value is not None:
            assert rule.contains(value), (dest, value)


@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "nan", r"^--lr \(nan\) must be a finite number and must be >= 0: the peak learning"),
    ("--lr", "-1e-3", r"^--lr \(-0\.001\) must be >= 0"),
    ("--clip-grad", "nan", r"^--clip-grad \(nan\) must be a finite number"),
    ("--clip-grad", "-1", r"^--clip-grad \(-1\.0\) must be >= 0: the global gradient-norm clip "
                          r"\(0 = off\); e\.g\. 1 \(the default\)"),
    ("--seed", "-1", r"^--seed \(-1\) must be in \[0, 4294967295\]: a seed"),
    ("--seed", "4294967296", r"^--seed \(4294967296\) must be in"),
    ("--weight-decay", "inf", r"^--weight-decay \(inf\) must be a finite number and must be >= 0"),
    ("--adam-beta1", "1.5", r"^--adam-beta1 \(1\.5\) must be in \[0, 1\): Adam's first-moment "
                            r"decay rate; e\.g\. 0\.9 \(the default\)"),
    ("--adam-beta2", "1", r"^--adam-beta2 \(1\.0\) must be in \[0, 1\)"),
    ("--adam-eps", "0", r"^--adam-eps \(0\.0\) must be positive"),
    ("--init-method-std", "-1", r"^--init-method-std \(-1\.0\) must be positive"),
    ("--hidden-dropout", "1", r"^--hidden-dropout \(1\.0\) must be in \[0, 1\): a dropout"),
    ("--attention-dropout", "-0.1", r"^--attention-dropout \(-0\.1\) must be in \[0, 1\)"),
    ("--norm-epsilon", "0", r"^--norm-epsilon \(0\.0\) must be positive"),
    ("--rotary-base", "nan", r"^--rotary-base \(nan\) must be a finite number"),
    ("--micro-batch-size", "0", r"^--micro-batch-size \(0\) must be positive: samples"),
    ("--num-layers", "-4", r"^--num-layers \(-4\) must be positive"),
    ("--lr-warmup-fraction", "1.5", r"^--lr-warmup-fraction \(1\.5\) must be in \[0, 1\]"),
    ("--loss-scale-window", "10.5", r"^--loss-scale-window \(10\.5\) must be >= 1 and a whole "
                                    r"number"),
    ("--initial-loss-scale", "inf", r"^--initial-loss-scale \(inf\) must be a finite number"),
    ("--min-loss-scale", "0", r"^--min-loss-scale \(0\.0\) must be positive"),
    ("--max-consecutive-nan-iterations", "-1", r"^--max-consecutive-nan-iterations \(-1\) must "
                                               r"be >= 0: iterations \(0 = never stop\)"),
    ("--distributed-timeout-minutes", "0", r"^--distributed-timeout-minutes \(0\.0\) must be "
                                           r"positive"),
    ("--exit-duration-in-mins", "nan", r"^--exit-duration-in-mins \(nan\) must be a finite"),
    ("--keep-last-checkpoints", "0", r"^--keep-last-checkpoints \(0\) must be positive"),
    ("--eval-iters", "-1", r"^--eval-iters \(-1\) must be >= 0"),
    ("--num-workers", "-2", r"^--num-workers \(-2\) must be >= 0"),
    ("--reduce-bucket-size", "0", r"^--reduce-bucket-size \(0\.0\) must be >= 1"),
    ("--peak-tflops", "-5", r"^--peak-tflops \(-5\.0\) must be positive"),
])
def test_out_of_range_values_are_refused_naming_the_flag(flag, value, message):
    with pytest.raises(UsageError, match=message):
        _validate(f"{flag}={value}")  # = : argparse reads "-1e-3" as an option


def test_the_seed_leaves_room_for_the_pipeline_offset():
    with pytest.raises(UsageError, match=r"^--seed \(4294967295\) must be at most 4294967195 with "
                                         r"--pipeline-model-parallel-size 2"):
        _validate("--seed", 2 ** 32 - 1, "--pipeline-model-parallel-size", 2)
    assert _validate("--seed", 2 ** 32 - 101, "--pipeline-model-parallel-size", 2).seed == 2 ** 32 - 101


def test_a_malformed_number_is_one_usage_error_line():
    with pytest.raises(UsageError, match=r"argument --lr: invalid float value: 'fast' \(see "
                                         r"pretrain_llama\.py --help\)"):
        parse_args(ARGV + ["--lr", "fast"])


def test_megatron_lm_nan_check_flags_map_onto_the_streak_limit():
    assert parse_args(ARGV).max_consecutive_nan_iterations == 3
    assert parse_args(ARGV + ["--check-for-nan-in-loss-and-grad"]).max_consecutive_nan_iterations == 1
    assert parse_args(ARGV + ["--no-check-for-nan-in-loss-and-grad"]
                      ).max_consecutive_nan_iterations == 0


def test_range_edges():
    unit = Range(0, 1, "p")
    assert unit.contains(0) and not unit.contains(1) and not unit.contains(math.nan)
    assert Range(0, 1, "p", high_open=False).contains(1)
    assert not Range(0, math.inf, "x", low_open=True).contains(0)
    assert not Range(0, math.inf, "x").contains(math.inf)


def _options():
    """dest -> (the first option string, its type) of every numeric flag."""
    return {a.dest: (a.option_strings[0], a.type) for a in build_parser()._actions
            if a.type in (int, float)}


def _below(rule, kind):
    low = rule.low if rule.low_open else rule.low - 1
    return str(int(low)) if kind is int else repr(float(low))


@pytest.mark.parametrize("dest", sorted(RANGES))
def test_every_flag_refuses_a_value_below_its_range_and_every_float_flag_nan_and_inf(dest):
    option, kind = _options()[dest]
    flag = re.escape(flag_of(dest))
    with pytest.raises(UsageError, match=rf"^{flag} \(-?[\d.e+]+\) must be "):
        _validate(f"{option}={_below(RANGES[dest], kind)}")
    for value in (("nan", "inf", "-inf") if kind is float else ()):
        with pytest.raises(UsageError, match=rf"^{flag} \({value}\) must be a finite number"):
            _validate(f"{option}={value}")
    if kind is int:  # argparse's own refusal, one line naming the flag
        with pytest.raises(UsageError, match=rf"argument {re.escape(option)}.*: invalid int value"):
            _validate(f"{option}=nan")
