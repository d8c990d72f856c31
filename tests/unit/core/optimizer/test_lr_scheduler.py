"""OptimizerParamScheduler against Megatron's formulas, evaluated by hand at chosen steps."""

import math

import pytest

from megatron.core.optimizer import OptimizerParamScheduler


class FakeOptimizer:
    def __init__(self):
        self.param_groups = [{"wd_mult": 1.0, "lr_mult": 1.0}, {"wd_mult": 0.0, "lr_mult": 0.5}]


def make(style="cosine", warmup=10, decay=110, init_lr=0.0, wd=(0.1, 0.1, "constant"), **kw):
    opt = FakeOptimizer()
    sched = OptimizerParamScheduler(opt, init_lr=init_lr, max_lr=1.0, min_lr=0.1,
                                    lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=style,
                                    start_wd=wd[0], end_wd=wd[1], wd_incr_steps=100,
                                    wd_incr_style=wd[2], **kw)
    return opt, sched


def lr_at(sched, step):
    sched.num_steps = 0
    sched.step(step)
    return sched.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("style,step,expected", [
    ("cosine", 0, 0.0), ("cosine", 5, 0.5), ("cosine", 10, 1.0),
    ("cosine", 35, 0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1)), ("cosine", 60, 0.55),
    ("cosine", 110, 0.1), ("cosine", 500, 0.1),
    ("linear", 35, 0.1 + 0.9 * 0.75), ("linear", 60, 0.55), ("linear", 111, 0.1),
    ("constant", 5, 0.5), ("constant", 60, 1.0), ("constant", 500, 1.0),
    ("inverse-square-root", 40, 0.5), ("inverse-square-root", 90, max(0.1, 10 ** 0.5 / 90 ** 0.5)),
])
def test_lr_values_match_megatron_formulas(style, step, expected):
    _, sched = make(style)
    assert lr_at(sched, step) == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("wsd_style,step,expected", [
    ("linear", 80, 1.0), ("linear", 100, 0.55), ("cosine", 95, 0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1)),
    ("exponential", 100, 0.1 + 0.9 * (2 * 0.5 ** 0.5 - 1)), ("exponential", 110, 0.1),
])
def test_wsd(wsd_style, step, expected):
    _, sched = make("WSD", wsd_decay_steps=20, lr_wsd_decay_style=wsd_style)
    assert lr_at(sched, step) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_warmup_from_init_lr_and_group_multipliers():
    opt, sched = make("linear", init_lr=0.2, wd=(0.0, 0.1, "linear"))
    sched.step(5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 + 0.8 * 0.5)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.5 * (0.2 + 0.8 * 0.5))
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.005)
    assert opt.param_groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("style,step,expected", [
    ("linear", 25, 0.025), ("cosine", 25, 0.1 * 0.5 * (math.cos(math.pi * 0.75) + 1)),
    ("cosine", 50, 0.05), ("linear", 150, 0.1),
])
def test_weight_decay_increment(style, step, expected):
    opt, sched = make(wd=(0.0, 0.1, style))
    sched.step(step)
    assert sched.get_wd() == pytest.approx(expected, rel=1e-12)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(expected, rel=1e-12)


def test_sample_based_steps():
    # Sample-based training: warmup/decay in samples, step(global batch size) per iteration.
    opt, sched = make("linear", warmup=80, decay=880)
    for _ in range(5):
        sched.step(8)
    assert sched.num_steps == 40
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_state_dict_round_trip_resumes_identically():
    _, a = make("cosine", use_checkpoint_opt_param_scheduler=False)
    for _ in range(37):
        a.step(1)
    sd = a.state_dict()
    assert all(isinstance(v, (int, float, str)) for v in sd.values())
    opt_b, b = make("cosine", use_checkpoint_opt_param_scheduler=False)
    b.load_state_dict(sd)
    b.load_state_dict(sd)  # idempotent
    assert b.num_steps == 37
    for _ in range(20):
        a.step(1)
        b.step(1)
        assert a.optimizer.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]


def test_load_policies():
    _, a = make("cosine", use_checkpoint_opt_param_scheduler=False)
    a.step(3)
    sd = dict(a.state_dict(), max_lr=2.0)
    _, strict = make("cosine", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="override-opt_param-scheduler"):
        strict.load_state_dict(sd)
    _, override = make("cosine", use_checkpoint_opt_param_scheduler=False,
                       override_opt_param_scheduler=True)
    override.load_state_dict(sd)
    assert override.max_lr == 1.0 and override.num_steps == 3
    _, take = make("cosine")
    take.load_state_dict(sd)
    assert take.max_lr == 2.0
    # Megatron's older key names.
    _, old = make("cosine")
    old.load_state_dict({"start_lr": 1.0, "min_lr": 0.1, "warmup_iter": 10, "end_iter": 110,
                         "decay_style": "cosine", "num_iters": 60})
    assert old.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)


@pytest.mark.parametrize("kwargs,match", [
    ({"warmup": 200}, "lr-warmup"), ({"decay": 0, "warmup": 0}, "lr-decay-iters"),
    ({"style": "exp"}, "lr-decay-style"), ({"style": "WSD"}, "WSD"),
    ({"init_lr": 5.0}, "lr-warmup-init"), ({"wd": (0.0, 0.1, "constant")}, "weight-decay-incr-style"),
    ({"override_opt_param_scheduler": True}, "choose one"),
])
def test_bad_values_raise_naming_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_build_from_args_counts_samples_like_megatron():
    """The configuration turns the lengths into samples once (megatron.config.builder); the
    scheduler built from it counts them like Megatron."""
    from argparse import Namespace

    from megatron.config.builder import build_scheduler_config
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer import build_opt_param_scheduler as build

    def build_opt_param_scheduler(opt, args):
        optimizer = OptimizerConfig(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay)
        return build(opt, optimizer, build_scheduler_config(args))

    opt = FakeOptimizer()
    args = Namespace(lr=1.0, min_lr=0.1, lr_decay_style="linear", train_iters=110, train_samples=None,
                     lr_decay_iters=None, lr_decay_samples=None, lr_warmup_fraction=None,
                     lr_warmup_iters=10, lr_warmup_samples=0, global_batch_size=8, weight_decay=0.1,
                     override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False)
    sched = build_opt_param_scheduler(opt, args)
    assert (sched.lr_warmup_steps, sched.lr_decay_steps, sched.wd_incr_steps) == (80, 880, 880)
    for _ in range(60):
        sched.step(increment=8)  # one iteration of the global batch
    assert opt.param_groups[0]["lr"] == pytest.approx(0.55)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1)
    samples = build_opt_param_scheduler(opt, Namespace(**dict(
        vars(args), train_iters=None, train_samples=880, lr_warmup_fraction=0.25)))
    assert (samples.lr_warmup_steps, samples.lr_decay_steps) == (220, 880)
    with pytest.raises(ValueError, match="--train-iters or --train-samples"):
        build_opt_param_scheduler(opt, Namespace(**dict(vars(args), train_iters=None)))
