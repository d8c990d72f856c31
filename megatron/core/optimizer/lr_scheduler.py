"""Learning-rate and weight-decay schedule (Megatron-LM's ``OptimizerParamScheduler``).

Steps are whatever the caller counts: iterations for iteration-based training, or samples for
sample-based training (``--train-samples``: the caller passes ``lr_warmup_steps`` etc. in samples
and calls ``step(global_batch_size)``), exactly as Megatron's ``get_optimizer_param_scheduler``.

Learning rate at step n (W = warmup steps, D = decay steps, a = max_lr, m = min_lr):

* warmup (W > 0 and n <= W): ``init_lr + (a - init_lr) * n / W``;
* ``constant``: ``a``; n > D: ``m``;
* ``inverse-square-root``: ``max(m, a * sqrt(max(W, 1)) / sqrt(max(n, 1)))``;
* with r = (n - W) / (D - W): ``linear`` ``m + (a - m)(1 - r)``; ``cosine``
  ``m + (a - m) * 0.5 (cos(pi r) + 1)``; ``WSD`` (warmup-stable-decay): ``a`` until
  ``D - wsd_decay_steps``, then a ``linear`` / ``cosine`` / ``exponential`` anneal to ``m``.

Weight decay at step n (``--start-weight-decay``, ``--end-weight-decay``,
``--weight-decay-incr-style constant|linear|cosine``) rises from start to end over
``wd_incr_steps``. Every param group gets ``lr * lr_mult`` and ``wd * wd_mult``.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

_LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WD_STYLES = ("constant", "linear", "cosine")
_WSD_STYLES = ("linear", "cosine", "exponential")


class ScheduleMismatchError(ValueError):
    """The flags' schedule differs from the checkpoint's (e.g. a resume with a longer
    ``--train-iters``, so ``--lr-decay-iters`` follows it) and neither policy flag says which
    wins: the user's to fix (the checkpoint loaders report it as a usage error)."""


class OptimizerParamScheduler:
    """Sets ``lr`` and ``weight_decay`` of every param group of ``optimizer`` at each step.

    Args:
        optimizer: anything with ``param_groups`` (a torch or Megatron optimizer).
        init_lr: lr at step 0 of the warmup (``--lr-warmup-init``).
        max_lr / min_lr: ``--lr`` / ``--min-lr``.
        lr_warmup_steps / lr_decay_steps: in iterations or samples (see module docstring).
        lr_decay_style: one of constant, linear, cosine, inverse-square-root, WSD.
        start_wd / end_wd / wd_incr_steps / wd_incr_style: the weight-decay ramp.
        use_checkpoint_opt_param_scheduler: on load, take the checkpoint's values.
        override_opt_param_scheduler: on load, keep this object's values (``--override-opt_param-scheduler``).
        wsd_decay_steps / lr_wsd_decay_style: the anneal phase of WSD.

    Raises:
        ValueError: for inconsistent values, naming the flag.
    """

    def __init__(self, optimizer, init_lr: float, max_lr: float, min_lr: float,
                 lr_warmup_steps: int, lr_decay_steps: int, lr_decay_style: str,
                 start_wd: float, end_wd: float, wd_incr_steps: int, wd_incr_style: str,
                 use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False,
                 wsd_decay_steps: Optional[int] = None, lr_wsd_decay_style: Optional[str] = None):
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self._validate()
        self.num_steps = 0
        self.step(0)

    def _validate(self) -> None:
        def check(ok, msg):
            if not ok:
                raise ValueError(msg)
        check(self.min_lr >= 0.0, f"--min-lr ({self.min_lr}) must be >= 0")
        check(self.max_lr >= self.min_lr, f"--lr ({self.max_lr}) must be >= --min-lr ({self.min_lr})")
        check(self.init_lr <= self.max_lr,
              f"--lr-warmup-init ({self.init_lr}) must be <= --lr ({self.max_lr})")
        check(self.lr_decay_steps > 0, f"--lr-decay-iters/--lr-decay-samples ({self.lr_decay_steps}) "
              "must be > 0")
        check(self.lr_warmup_steps < self.lr_decay_steps,
              f"lr warmup ({self.lr_warmup_steps} steps) must be shorter than lr decay "
              f"({self.lr_decay_steps} steps); lower --lr-warmup-iters/--lr-warmup-fraction or raise "
              "--lr-decay-iters")
        check(self.lr_decay_style in _LR_STYLES,
              f"--lr-decay-style {self.lr_decay_style} is not one of {', '.join(_LR_STYLES)}")
        if self.lr_decay_style == "WSD":
            check(self.wsd_decay_steps is not None and self.lr_wsd_decay_style in _WSD_STYLES,
                  "--lr-decay-style WSD needs --lr-wsd-decay-iters/--lr-wsd-decay-samples and "
                  f"--lr-wsd-decay-style in {', '.join(_WSD_STYLES)}")
        check(0.0 <= self.start_wd <= self.end_wd,
              f"--start-weight-decay ({self.start_wd}) must be in [0, --end-weight-decay ({self.end_wd})]")
        check(self.wd_incr_style in _WD_STYLES,
              f"--weight-decay-incr-style {self.wd_incr_style} is not one of {', '.join(_WD_STYLES)}")
        check(self.wd_incr_style != "constant" or self.start_wd == self.end_wd,
              "--weight-decay-incr-style constant needs --start-weight-decay == --end-weight-decay")
        check(not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
              "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are both set; "
              "choose one")

    def get_wd(self) -> float:
        """Weight decay at the current step."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict) -> float:
        """Learning rate at the current step (a group may carry its own ``max_lr`` / ``min_lr``)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        n, warmup = self.num_steps, self.lr_warmup_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(warmup)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - warmup) / float(self.lr_decay_steps - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                r = float(n - anneal_start) / float(self.wsd_decay_steps)
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - r
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
                else:
                    coeff = 2.0 * math.pow(0.5, r) - 1.0
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` steps (1 iteration, or the global batch size in samples)."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = new_wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        """Megatron's keys, plain Python values."""
        return {"max_lr": self.max_lr, "lr_warmup_steps": self.lr_warmup_steps,
                "num_steps": self.num_steps, "lr_decay_style": self.lr_decay_style,
                "lr_decay_steps": self.lr_decay_steps, "min_lr": self.min_lr,
                "start_wd": self.start_wd, "end_wd": self.end_wd,
                "wd_incr_style": self.wd_incr_style, "wd_incr_steps": self.wd_incr_steps}

    def _check_and_set(self, cls_value, sd_value, name: str):
        if self.override_opt_param_scheduler:
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ScheduleMismatchError(f"OptimizerParamScheduler: {name} is {cls_value} but the checkpoint "
                             f"has {sd_value}; pass --override-opt_param-scheduler to keep the new "
                             "value or --use-checkpoint-opt_param-scheduler to take the checkpoint's")
        return sd_value

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the step count and (per the override / use-checkpoint policy) the schedule.

        Accepts the older Megatron key names (``start_lr``, ``warmup_iter``/``warmup_steps``,
        ``end_iter``/``decay_steps``, ``decay_style``, ``num_iters``).
        """
        sd = state_dict

        def first(*keys):
            return next(sd[k] for k in keys if k in sd)

        self.max_lr = self._check_and_set(self.max_lr, first("start_lr", "max_lr"), "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, sd["min_lr"], "minimum learning rate")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps, first("warmup_iter", "warmup_steps", "lr_warmup_steps"), "warmup steps")
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps, first("end_iter", "decay_steps", "lr_decay_steps"),
            "total number of decay steps")
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, first("decay_style", "lr_decay_style"), "learning rate decay style")
        if "start_wd" in sd:
            self.start_wd = self._check_and_set(self.start_wd, sd["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, sd["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(self.wd_incr_steps, sd["wd_incr_steps"],
                                                     "total number of weight decay iterations")
            self.wd_incr_style = self._check_and_set(self.wd_incr_style, sd["wd_incr_style"],
                                                     "weight decay incr style")
        # Megatron adds the saved count to a fresh scheduler; reset first so a reload is idempotent.
        self.num_steps = 0
        self.step(first("num_iters", "num_steps"))


def lr_schedule_steps(*, global_batch_size: int, train_iters: Optional[int],
                      train_samples: Optional[int], lr_decay_iters: Optional[int] = None,
                      lr_decay_samples: Optional[int] = None, lr_warmup_iters: int = 0,
                      lr_warmup_samples: int = 0, lr_warmup_fraction: Optional[float] = None
                      ) -> Tuple[float, int, int]:
    """``(warmup, decay, weight-decay increment)`` lengths in samples (Megatron's
    ``get_optimizer_param_scheduler`` arithmetic).

    Iteration-based lengths (``--train-iters``) are multiplied by the global batch; sample-based
    ones (``--train-samples``) are taken as they are; ``lr_warmup_fraction`` replaces the warmup
    by that fraction of the decay. A missing decay length is the training length.

    Raises:
        ValueError: if neither ``train_iters`` nor ``train_samples`` is set.
    """
    if train_iters:
        decay = (lr_decay_iters or train_iters) * global_batch_size
        wd_incr = train_iters * global_batch_size
        warmup = (lr_warmup_iters or 0) * global_batch_size
    elif train_samples:
        decay = lr_decay_samples or train_samples
        wd_incr = train_samples
        warmup = lr_warmup_samples or 0
    else:
        raise ValueError("set --train-iters or --train-samples to build the learning-rate schedule")
    if lr_warmup_fraction is not None:
        warmup = lr_warmup_fraction * decay
    return warmup, decay, wd_incr


def build_opt_param_scheduler(optimizer, optimizer_config, scheduler_config
                              ) -> OptimizerParamScheduler:
    """The scheduler of a run (Megatron's ``get_optimizer_param_scheduler``), counted in samples:
    the training loop calls ``step(increment=global_batch_size)`` once per iteration, so
    checkpoints store ``num_steps`` in samples as Megatron's do.

    Args:
        optimizer: the optimizer whose ``param_groups`` the scheduler writes.
        optimizer_config: ``lr``, ``min_lr`` and ``weight_decay``
            (:class:`~megatron.core.optimizer.optimizer_config.OptimizerConfig`).
        scheduler_config: the schedule, its lengths already in samples
            (:class:`~megatron.core.optimizer.optimizer_config.SchedulerConfig`).

    Raises:
        ValueError: for inconsistent values (from the scheduler).
    """
    s, wd = scheduler_config, optimizer_config.weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=optimizer_config.lr, min_lr=optimizer_config.min_lr,
        lr_warmup_steps=s.lr_warmup_steps, lr_decay_steps=s.lr_decay_steps,
        lr_decay_style=s.lr_decay_style, start_wd=wd, end_wd=wd, wd_incr_steps=s.wd_incr_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler)
