"""AdamW wrapped for Megatron-style training: fp32 main params, main grads, clipping, zero counting.

After Megatron-LM's ``megatron/core/optimizer/optimizer.py``:

* :class:`FP32Optimizer`: fp32 model; the DDP buffer's ``main_grad`` is used as the gradient.
* :class:`MixedPrecisionOptimizer`: the mixed-precision main grads and params;
  :class:`Float16OptimizerWithFloat16Params` keeps an fp32 main copy of every bf16/fp16
  parameter, steps the main copy and copies it back; the distributed optimizer derives from it.

``step(nonfinite_loss=False)`` runs Megatron-Core's three phases, each a method with one job:

1. :meth:`MegatronOptimizer.prepare_grads`: the main grads (model grads copied or aliased),
   unscaled under fp16, and the skip flag: inf/NaN in a gradient or in this rank's loss
   (``nonfinite_loss``), all-reduced so every rank decides alike;
2. :meth:`MegatronOptimizer.clip_grad_norm`: the global norm and the clip factor;
3. :meth:`MegatronOptimizer.step_with_ready_grads`: AdamW on the main params, copied back to the
   model params.

It returns ``(update_successful, grad_norm, num_zeros_in_grad)`` as Megatron does: ``grad_norm``
is None when ``clip_grad`` is 0, ``num_zeros_in_grad`` None unless ``log_num_zeros_in_grad``;
``update_successful`` is False (and nothing is updated) on an fp16 overflow (the grad scaler backs
off) or a non-finite bf16/fp32 iteration.

The host/device difference is one branch of :meth:`MegatronOptimizer.step`: on the host (CPU) the
flag and the norm are read as each phase ends; on CUDA with torch's fused AdamW nothing is read
before the kernel is queued (the flag and the clip factor reach it as its ``found_inf`` and
``grad_scale`` tensors) and the flag and the norm are read once after it.

The groups are constructor arguments (``pg_collection``): the norm and the flag are combined over
the model-parallel group (TP x PP), and, for gradients sharded over data parallelism, over the
distributed optimizer's data-parallel group.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.optimizer.clip_grads import (clip_coefficient, clip_grads_by_total_norm,
                                                count_zeros_fp32, grad_norm_power_fp32,
                                                grads_for_norm, model_parallel_group_of,
                                                param_grad)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.process_groups import ProcessGroupCollection

# Attributes that tell the norm how to count a parameter; main params must carry them too.
_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride",
                   "shared_embedding", "sequence_parallel")

StepResult = Tuple[bool, Optional[float], Optional[int]]


class MegatronOptimizer:
    """Base wrapper: owns the torch optimizer, the config, an optional grad scaler and the step.

    Args:
        optimizer: a torch optimizer over the (main) parameters.
        config: the :class:`~megatron.core.optimizer.optimizer_config.OptimizerConfig`.
        grad_scaler: None (fp32, bf16) or an fp16 loss scaler with ``scale``, ``inv_scale``,
            ``update(found_inf)``, ``state_dict()`` and ``load_state_dict()``.
        pg_collection: this rank's process groups (the norm counts each element once over its
            ``tp`` and pipeline stages and sums over its ``model`` group).
        expert: the parameters are expert parameters (a part of a
            :class:`~megatron.core.optimizer.chained_optimizer.ChainedOptimizer`): duplicates
            are found over ``expt_tp`` and the norm summed over ``tp_ep_pp``.

    The optimizer protocol the training loop and the checkpoints use (no attribute probes):
    ``kind`` (``"plain"`` or ``"distributed"``: the latter has :meth:`parameter_state` /
    :meth:`load_parameter_state`, one file per data-parallel rank in the legacy format),
    :meth:`sharded_state_dict` / :meth:`sharded_load_targets` (``torch_dist``),
    :meth:`reload_model_params`, :meth:`finish_param_sync`, ``grad_scaler``.
    """

    kind = "plain"
    # Float16OptimizerWithFloat16Params: fp32 copies of the bf16/fp16 params, saved under
    # Megatron's "fp32_from_fp16_params".
    keeps_fp32_main_params = False
    # Tests set True to take the device path of step() on the CPU (_steps_on_device).
    device_side_step: Optional[bool] = None

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler=None, *, pg_collection: ProcessGroupCollection,
                 expert: bool = False):
        self.optimizer = optimizer
        self.config = config
        self.grad_scaler = grad_scaler
        self.pg_collection = pg_collection
        self.expert = expert
        self.model_parallel_group = model_parallel_group_of(pg_collection, expert)

    # What subclasses provide ---------------------------------------------------------------------

    def _copy_model_grads_to_main_grads(self) -> None:
        """Make the main params' ``.grad`` the step's gradients."""
        raise NotImplementedError

    def _main_grads(self) -> List[torch.Tensor]:
        """The gradients the step reads (the main params' ``.grad``)."""
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    def _copy_main_params_to_model_params(self) -> None:
        """Write the stepped main params back into the model params (nothing for fp32)."""

    def _after_step(self, update_successful: bool) -> None:
        """Release what the step held (gradient aliases); start what follows it."""

    def _data_parallel_group(self):
        """The group the main grads are sharded over (distributed optimizer), else None."""
        return None

    # Reading the model's gradients ---------------------------------------------------------------

    def get_parameters(self) -> List[torch.nn.Parameter]:
        """The parameters the torch optimizer updates (the main params)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        return grads_for_norm(self.get_parameters(), self.pg_collection, self.expert)

    def get_grad_norm(self) -> float:
        """Global L2 norm of the main grads, each element of the model counted once."""
        return self._grad_norm_power().item() ** 0.5

    def _grad_norm_power(self) -> torch.Tensor:
        """Sum of squares of the main grads of the whole model: a 0-dim fp64 device tensor
        (layout-exact to fp32 rounding: :func:`~megatron.core.optimizer.clip_grads.tensor_power_sums`)."""
        return grad_norm_power_fp32(self.get_main_grads_for_grad_norm(), 2.0,
                                    model_parallel_group=self.model_parallel_group,
                                    data_parallel_group=self._data_parallel_group(),
                                    device=self._collective_device())

    def _collective_device(self) -> Optional[torch.device]:
        """Where the step's flag and norm are reduced: None for the main grads' device (an
        offloaded optimizer reduces its host results on the model's device)."""
        return None

    def count_zeros(self) -> int:
        return count_zeros_fp32(self.get_parameters(), pg_collection=self.pg_collection,
                                data_parallel_group=self._data_parallel_group(),
                                expert=self.expert)

    def flag_groups(self) -> List:
        """The groups the skip flag is agreed over (max): the model-parallel group, and the
        data-parallel group when the main grads are DP shards; None entries dropped."""
        return [g for g in (self.model_parallel_group, self._data_parallel_group())
                if g is not None]

    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is None:
            return torch.tensor(1.0)
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the loss scale before backward (identity without a grad scaler)."""
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    # The step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, nonfinite_loss=False) -> StepResult:
        """One optimizer step in Megatron-Core's phases (see the module docstring).

        Args:
            nonfinite_loss: this rank's loss is inf/NaN (a 0-dim bool device tensor, or a
                bool; False where no loss is computed): folded into the step's one all-reduce of
                the skip flag, so an inf/NaN loss skips the step on every rank alike.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``.
        """
        found_inf = self.prepare_grads(nonfinite_loss)
        if self._steps_on_device():
            result = self._step_reading_once(found_inf)
        else:
            result = self._step_reading_as_it_goes(found_inf)
        self._after_step(result[0])
        return result

    def _step_reading_as_it_goes(self, found_inf: torch.Tensor) -> StepResult:
        """The host path: the flag is read after phase 1, the norm after phase 2."""
        skipped = bool(found_inf.item() > 0)
        if self.grad_scaler is not None:
            self.grad_scaler.update(skipped)
        if skipped:
            return False, None, None
        grad_norm, grad_scale = self.clip_grad_norm()
        if grad_norm is not None and not math.isfinite(grad_norm):
            return False, grad_norm, None  # the same norm on every rank: every rank skips
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        self.step_with_ready_grads(grad_scale=grad_scale)
        return True, grad_norm, num_zeros

    def _step_reading_once(self, found_inf: torch.Tensor) -> StepResult:
        """The device path: phases 2 and 3 on device tensors, then the step's one host read (the
        flag and the squared norm together); the fp16 scaler is updated after it."""
        power, grad_scale, skip = self.clip_grad_norm_on_device(found_inf)
        self.step_with_ready_grads(grad_scale=grad_scale, found_inf=skip)
        flagged, power = torch.stack([found_inf.double(), power.double()]).tolist()
        if self.grad_scaler is not None:
            self.grad_scaler.update(flagged > 0)
        grad_norm = power ** 0.5 if self.config.clip_grad > 0 else None
        if flagged > 0:
            return False, None, None
        return grad_norm is None or math.isfinite(grad_norm), grad_norm, None

    def prepare_grads(self, nonfinite_loss=False) -> torch.Tensor:
        """Phase 1: the main grads, unscaled under fp16, and the skip flag.

        Returns:
            a 0-dim fp32 device tensor, 1 when any main gradient, or the loss of any rank
            (``nonfinite_loss``), is inf/NaN, else 0. The gradients themselves are left to the
            norm when :meth:`_norm_checks_grads`.

        Collective: all-reduce (max) of the flag over the model-parallel group, and over the
        data-parallel group when the main grads are DP shards (distributed optimizer).
        """
        self._copy_model_grads_to_main_grads()
        grads = self._main_grads()
        device = self._collective_device() or (grads[0].device if grads else torch.device("cpu"))
        # Made on the device, never copied from the host: a host-to-GPU copy waits for the queue.
        found = torch.zeros((), dtype=torch.float32, device=device)
        if isinstance(nonfinite_loss, torch.Tensor):
            found = torch.maximum(found, nonfinite_loss.to(device=device,
                                                           dtype=torch.float32).reshape(()))
        elif nonfinite_loss:
            found.fill_(1.0)
        inv_scale = None if self.grad_scaler is None else self.grad_scaler.inv_scale
        if inv_scale is not None and grads:
            # The scaler's CPU scale as a number on the GPU (exact: the fp32 value), not a copy.
            factor = inv_scale.item() if device.type != inv_scale.device.type else inv_scale
            torch._foreach_mul_(grads, factor)
        if grads and not self._norm_checks_grads():
            # A sum is inf/NaN iff an element is (or the sum overflows fp32, i.e. the gradient is
            # past any useful range): one read pass, where isfinite().any() makes five.
            sums = torch.stack([g.sum(dtype=torch.float32) for g in grads])
            found = torch.maximum(found, (~torch.isfinite(sums)).any().float().to(device))
        for group in self.flag_groups():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return found

    def _norm_checks_grads(self) -> bool:
        """True when the step's gradient norm (clipping on, no loss scaler) tells whether a
        gradient is inf/NaN: the norm is then non-finite, and no separate pass over the
        gradients is needed (an fp32 sum of squares overflowing, at gradients above 1e19, counts
        as non-finite too)."""
        return self.grad_scaler is None and self.config.clip_grad > 0

    def clip_grad_norm(self) -> Tuple[Optional[float], Optional[torch.Tensor]]:
        """Phase 2 on the host: ``(grad_norm, grad_scale)``.

        ``grad_norm`` is None without clipping. With torch's fused AdamW the clipping is folded
        into the step: ``grad_scale = 1 / clip_coeff`` is handed to the kernel, which divides each
        gradient by it as it reads it and writes the clipped value back, so the gradients end as
        clipping in place leaves them (within rounding: ``g / (1/c)`` for ``g * c``) without a
        separate read-and-write pass over them. Otherwise (or with ``log_num_zeros_in_grad``,
        which counts the clipped gradients) they are clipped in place and ``grad_scale`` is None.
        """
        if self.config.clip_grad <= 0:
            return None, None
        grad_norm = self.get_grad_norm()
        if not math.isfinite(grad_norm):
            return grad_norm, None
        clip_coeff = clip_coefficient(self.config.clip_grad, grad_norm)
        if clip_coeff >= 1.0:
            return grad_norm, None
        if self._fused_step() and not self.config.log_num_zeros_in_grad:
            device = self.get_parameters()[0].device
            return grad_norm, torch.tensor(1.0 / clip_coeff, dtype=torch.float32, device=device)
        grads = [g for g in (param_grad(p) for p in self.get_parameters()) if g is not None]
        clip_grads_by_total_norm(grads, self.config.clip_grad, grad_norm)
        return grad_norm, None

    def clip_grad_norm_on_device(self, found_inf: torch.Tensor):
        """Phase 2 on the device: ``(squared norm, grad_scale, skip)``, device tensors.

        ``skip`` adds an inf/NaN norm to ``found_inf``; ``grad_scale`` is the clip's
        ``1 / clip_coeff``, or 1 when the norm is within the clip (or the step is skipped); both
        None-free so the fused kernel takes them as they are. Without clipping the squared norm
        is 0 and ``grad_scale`` None.
        """
        skip = found_inf > 0
        clip = self.config.clip_grad
        if clip <= 0:
            return torch.zeros_like(found_inf), None, skip
        power = self._grad_norm_power().to(found_inf.device)
        skip = skip | ~torch.isfinite(power)
        inv_coeff = (power.double().sqrt() + 1.0e-6) / clip
        grad_scale = torch.where(skip | (inv_coeff <= 1.0), torch.ones_like(inv_coeff),
                                 inv_coeff).float()
        return power, grad_scale, skip

    def step_with_ready_grads(self, grad_scale: Optional[torch.Tensor] = None,
                              found_inf: Optional[torch.Tensor] = None) -> None:
        """Phase 3: AdamW on the main params, then the copy back to the model params.

        ``grad_scale`` and ``found_inf`` (device tensors, or None) are read by torch's fused
        Adam/AdamW kernel (the attributes ``torch.amp.GradScaler`` sets for it): each gradient is
        divided by ``grad_scale``; with ``found_inf`` 1 the kernel leaves parameters and moments
        untouched and takes its step count back. The copy back runs either way: after a skipped
        step the main params are unchanged and it rewrites the model params with their own values.
        """
        if grad_scale is not None:
            self.optimizer.grad_scale = grad_scale
        if found_inf is not None:
            self.optimizer.found_inf = found_inf.float()
        try:
            self.optimizer.step()
        finally:
            for attr in ("grad_scale", "found_inf"):
                if attr in vars(self.optimizer):
                    delattr(self.optimizer, attr)
        self._copy_main_params_to_model_params()

    def _fused_step(self) -> bool:
        """True when the torch optimizer is torch's fused Adam/AdamW (it honours ``grad_scale``)
        on one device, and nobody else (torch's ``GradScaler``) has set a ``grad_scale`` on it."""
        groups = self.optimizer.param_groups
        params = [p for g in groups for p in g["params"]]
        return (isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)) and bool(params)
                and all(g.get("fused") for g in groups)
                and len({p.device for p in params}) == 1
                and getattr(self.optimizer, "grad_scale", None) is None)

    def _steps_on_device(self) -> bool:
        """True for the step without host syncs (:meth:`_step_reading_once`): parameters on CUDA
        (on the CPU a host read waits for nothing) or ``device_side_step = True`` set on this
        object (tests), torch's fused AdamW, no zero counting (a count is a host read)."""
        forced = self.device_side_step
        params = self.get_parameters()
        on_device = forced if forced is not None else bool(params) and params[0].is_cuda
        return on_device and self._fused_step() and not self.config.log_num_zeros_in_grad

    def sharded_state_dict(self, shardings):
        """This rank's state in global coordinates (``--ckpt-format torch_dist``; see
        :mod:`megatron.core.optimizer.sharded_state`).

        Args:
            shardings: ``{model parameter: ParamSharding}`` (:func:`megatron.model.sharded_state.model_shardings`).

        Returns:
            a :class:`~megatron.core.optimizer.sharded_state.ShardedState` (boxes are views).
        """
        from megatron.core.optimizer.sharded_state import plain_sharded_state
        return plain_sharded_state(self, shardings)

    def sharded_load_targets(self, shardings, saved_keys: set):
        """The boxes a load fills, and the ``finish(common)`` that installs them as this
        optimizer's state; ``saved_keys`` are the checkpoint's tensor keys."""
        from megatron.core.optimizer.sharded_state import plain_load_targets
        return plain_load_targets(self, shardings, saved_keys)

    def reload_model_params(self) -> None:
        """Refresh main params from the model params (after loading a model without optimizer)."""

    def finish_param_sync(self) -> None:
        """Complete pending parameter all-gathers (nothing but for the distributed optimizer)."""

    def model_main_pairs(self) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(model parameter, main parameter)`` of a plain optimizer (the same tensor for
        fp32)."""
        return [(p, p) for p in self.get_parameters()]


class FP32Optimizer(MegatronOptimizer):
    """fp32 model: the optimizer updates the model parameters with ``main_grad`` as gradient."""

    def _copy_model_grads_to_main_grads(self) -> None:
        for p in self.get_parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad  # a view: no copy

    def _after_step(self, update_successful: bool) -> None:
        for p in self.get_parameters():
            if getattr(p, "main_grad", None) is not None:
                # Drop the alias, or the next backward would accumulate into main_grad twice.
                p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Mixed-precision main grads and params: subclasses implement
    ``_copy_model_grads_to_main_grads()``, ``_main_grads()`` and
    ``_copy_main_params_to_model_params()``."""


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """bf16/fp16 model params with fp32 main params (Megatron's class of the same name).

    The torch optimizer's groups are rewritten in place: every bf16/fp16 param is replaced by an
    fp32 clone carrying the same parallel attributes; fp32 params stay as they are.

    Raises:
        TypeError: for a parameter that is neither fp32, bf16 nor fp16.
    """

    def __init__(self, optimizer, config, grad_scaler=None, *, pg_collection, expert=False):
        super().__init__(optimizer, config, grad_scaler, pg_collection=pg_collection,
                         expert=expert)
        self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups = [], [], []
        for group in self.optimizer.param_groups:
            f16, main, f32 = [], [], []
            for i, p in enumerate(group["params"]):
                if p.dtype in (torch.float16, torch.bfloat16):
                    mp = p.detach().clone().float()
                    for attr in _PARALLEL_ATTRS:
                        if hasattr(p, attr):
                            setattr(mp, attr, getattr(p, attr))
                    group["params"][i] = mp
                    if p in self.optimizer.state:
                        self.optimizer.state[mp] = self.optimizer.state.pop(p)
                    f16.append(p)
                    main.append(mp)
                elif p.dtype == torch.float32:
                    f32.append(p)
                else:
                    raise TypeError(f"parameter dtype {p.dtype} is not supported; expected "
                                    "torch.float32, torch.bfloat16 or torch.float16")
            self.float16_groups.append(f16)
            self.fp32_from_float16_groups.append(main)
            self.fp32_from_fp32_groups.append(f32)

    keeps_fp32_main_params = True

    def _pairs(self):
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            yield from zip(model_group, main_group)

    def model_main_pairs(self) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        pairs = []
        for f16, mains, f32 in zip(self.float16_groups, self.fp32_from_float16_groups,
                                   self.fp32_from_fp32_groups):
            pairs += list(zip(f16, mains)) + [(p, p) for p in f32]
        return pairs

    def _main_grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_param, main_param in self._pairs():
            g = param_grad(model_param)
            main_param.grad = None if g is None else g.float()  # no copy when g is already fp32
        for group in self.fp32_from_fp32_groups:
            for p in group:
                if getattr(p, "main_grad", None) is not None:
                    p.grad = p.main_grad

    def _copy_main_params_to_model_params(self) -> None:
        for model_param, main_param in self._pairs():
            model_param.data.copy_(main_param.data)

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for model_param, main_param in self._pairs():
                main_param.copy_(model_param.float())

    def zero_grad(self, set_to_none: bool = True) -> None:
        groups = self.float16_groups + self.fp32_from_float16_groups + self.fp32_from_fp32_groups
        for group in groups:
            for p in group:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict:
        """``{"optimizer": torch state, "fp32_from_fp16_params": [[fp32 main param]]}`` (Megatron's
        keys), plus ``"grad_scaler"`` when one is set. Tensors are references, not copies."""
        sd = {"optimizer": self.optimizer.state_dict(),
              "fp32_from_fp16_params": [list(g) for g in self.fp32_from_float16_groups]}
        if self.grad_scaler is not None:
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore Adam state and the fp32 main params exactly.

        Raises:
            ValueError: if the checkpoint's main params do not match this model's shapes.
        """
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved = state_dict["fp32_from_fp16_params"]
        if [len(g) for g in saved] != [len(g) for g in self.fp32_from_float16_groups]:
            raise ValueError("optimizer checkpoint: fp32_from_fp16_params groups do not match the "
                             "model; load with --no-load-optim or use the same model configuration")
        with torch.no_grad():
            for current_group, saved_group in zip(self.fp32_from_float16_groups, saved):
                for current, value in zip(current_group, saved_group):
                    if current.shape != value.shape:
                        raise ValueError(f"optimizer checkpoint: main param shape {tuple(value.shape)} "
                                         f"!= model's {tuple(current.shape)}; load with "
                                         "--no-load-optim or use the same model configuration")
                    current.copy_(value)
