"""fp16 loss scalers: a constant scale, or Megatron's dynamic scale with hysteresis.

After Megatron-LM's ``megatron/core/optimizer/grad_scaler.py`` (the dynamic rule of Micikevicius
et al. 2018, "Mixed Precision Training", section 3.2, with Megatron's hysteresis): the loss is
multiplied by ``scale`` before backward, the main gradients by ``inv_scale`` after; an iteration
whose gradients hold inf/NaN is skipped. The dynamic scaler

* on an overflow, resets the clean-iteration count and spends one unit of hysteresis; once the
  hysteresis is spent (``hysteresis`` overflows since the last growth) it multiplies the scale by
  ``backoff_factor`` (0.5) on this and every further overflow, never below ``min_scale``;
* after ``growth_interval`` (``--loss-scale-window``) clean iterations in a row, multiplies the
  scale by ``growth_factor`` (2) and refills the hysteresis.

The scale is a 0-d fp32 CPU tensor: it multiplies a loss on any device without a copy.
"""

from __future__ import annotations

import torch


class MegatronGradScaler:
    """The interface the optimizer uses: ``scale``, ``inv_scale``, ``update(found_inf)``,
    ``state_dict()``, ``load_state_dict()``.

    Raises:
        ValueError: for a scale that is not positive and finite.
    """

    # The lowest scale a dynamic scaler backs off to; None for a constant scale (no floor to
    # reach: it never backs off).
    min_scale = None

    def __init__(self, initial_scale: float):
        if not (initial_scale > 0 and initial_scale < float("inf")):
            raise ValueError(f"loss scale ({initial_scale}) must be positive and finite")
        self._scale = torch.tensor(float(initial_scale), dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        """The loss multiplier, 0-d fp32."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` (computed in fp64, returned 0-d fp32)."""
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def state_dict(self) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """``--loss-scale S``: the scale never changes; overflowing iterations are still skipped."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scale (``--initial-loss-scale``, ``--min-loss-scale``,
    ``--loss-scale-window``, ``--hysteresis``).

    Args:
        initial_scale: the scale of the first iteration.
        min_scale: the scale never backs off below this.
        growth_factor: multiplier after ``growth_interval`` clean iterations (> 1).
        backoff_factor: multiplier on an overflow once the hysteresis is spent (in (0, 1)).
        growth_interval: clean iterations in a row before the scale grows (>= 1).
        hysteresis: overflows tolerated (since the last growth) before the scale backs off (>= 1).

    Raises:
        ValueError: for a value outside those ranges, naming its flag.
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        super().__init__(initial_scale)
        if not min_scale > 0:
            raise ValueError(f"--min-loss-scale ({min_scale}) must be positive")
        if min_scale > initial_scale:
            raise ValueError(f"--min-loss-scale ({min_scale}) must be <= --initial-loss-scale "
                             f"({initial_scale})")
        if not growth_factor > 1.0:
            raise ValueError(f"loss-scale growth factor ({growth_factor}) must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"loss-scale backoff factor ({backoff_factor}) must be in (0, 1)")
        if growth_interval < 1 or int(growth_interval) != growth_interval:
            raise ValueError(f"--loss-scale-window ({growth_interval}) must be a whole number >= 1")
        if hysteresis < 1:
            raise ValueError(f"--hysteresis ({hysteresis}) must be >= 1")
        self.min_scale = torch.tensor(float(min_scale), dtype=torch.float32)
        self.growth_factor = torch.tensor(float(growth_factor), dtype=torch.float32)
        self.backoff_factor = torch.tensor(float(backoff_factor), dtype=torch.float32)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Advance the rule by one iteration; ``found_inf`` must be equal on every rank."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.maximum(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        """Megatron's keys: ``scale`` (0-d fp32 tensor), ``growth_tracker``,
        ``hysteresis_tracker`` (ints)."""
        return {"scale": self._scale.clone(), "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        # Megatron saves a [1] CUDA tensor; keep ours a 0-d CPU tensor whatever was saved.
        self._scale = torch.as_tensor(state_dict["scale"]).detach().float().cpu().reshape(())
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def build_grad_scaler(config) -> MegatronGradScaler | None:
    """The scaler of an :class:`~megatron.core.optimizer.optimizer_config.OptimizerConfig` (Megatron's
    choice in ``get_megatron_optimizer``): None unless ``fp16``; ``ConstantGradScaler`` for
    ``--loss-scale``; else ``DynamicGradScaler(initial_loss_scale, min_loss_scale, 2.0, 0.5,
    loss_scale_window, hysteresis)``.

    Raises:
        ValueError: for invalid scaler settings (see the scaler classes).
    """
    if not config.fp16:
        return None
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(initial_scale=config.initial_loss_scale,
                             min_scale=config.min_loss_scale, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=config.loss_scale_window,
                             hysteresis=config.hysteresis)
