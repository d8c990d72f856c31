"""AdamW wrapped for Megatron-style training: fp32 main params, main grads, clipping, zero counting.

After Megatron-LM's ``megatron/core/optimizer/optimizer.py``:

* :class:`FP32Optimizer`: fp32 model; the DDP buffer's ``main_grad`` is used as the gradient.
* :class:`MixedPrecisionOptimizer`: the step shared by mixed-precision optimizers (unscale and
  inf check when a grad scaler is set, clip, step, copy back); :class:`Float16OptimizerWithFloat16Params`
  keeps an fp32 main copy of every bf16/fp16 parameter, steps the main copy and copies it back.
  The distributed optimizer will derive from :class:`MixedPrecisionOptimizer` too.

``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)`` as Megatron does:
``grad_norm`` is None when ``clip_grad`` is 0, ``num_zeros_in_grad`` None unless
``log_num_zeros_in_grad``; ``update_successful`` is False (and nothing is updated) when a main
gradient, or the loss flagged through ``nonfinite_loss``, is inf/NaN on any rank: an fp16 overflow
(the grad scaler backs off) or a non-finite bf16/fp32 iteration.

On CUDA with torch's fused AdamW the step reads nothing on the host before the kernel is queued
(:meth:`MegatronOptimizer._step_on_device`): the skip flag and the clip factor reach the kernel
as its ``found_inf`` and ``grad_scale`` tensors, and the flag and the norm are read once after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import (clip_coefficient, clip_grads_by_total_norm,
                                                count_zeros_fp32, grad_norm_power_fp32,
                                                grads_for_norm, param_grad)

# Attributes that tell the norm how to count a parameter; main params must carry them too.
_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride",
                   "shared_embedding", "sequence_parallel")


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer settings; field names are Megatron's ``args`` names (``--adam-beta1`` -> adam_beta1),
    so ``megatron.config.build_optimizer_config`` fills it from the parsed flags.

    Attributes:
        optimizer: only ``"adam"`` (AdamW with decoupled weight decay, as Megatron's Adam).
        lr / min_lr: peak and final learning rate (the scheduler sets the lr every step).
        weight_decay: decoupled L2 coefficient for parameters with 2+ dims (none on norms, biases).
        adam_beta1 / adam_beta2 / adam_eps: Adam coefficients.
        clip_grad: global L2 norm to clip to; 0 disables clipping (and the norm computation).
        bf16 / fp16: model parameters in bf16/fp16 with fp32 main params.
        params_dtype: the model parameter dtype.
        loss_scale ... hysteresis: fp16 loss scaling (:mod:`~megatron.core.optimizer.grad_scaler`).
        use_distributed_optimizer: shard optimizer state over DP (``DistributedOptimizer``).
        overlap_grad_reduce / overlap_param_gather: overlaps of the distributed optimizer.
        accumulate_allreduce_grads_in_fp32: fp32 gradient buffers and reduction.
        log_num_zeros_in_grad: count zero gradient elements each step.

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
    params_dtype: torch.dtype = torch.float32
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    accumulate_allreduce_grads_in_fp32: bool = True
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


def get_param_groups(model_chunks: List[torch.nn.Module], weight_decay: float) -> List[dict]:
    """Two AdamW groups: decayed (2+-dim weights) and not decayed (1-dim params and biases).

    Each group carries Megatron's ``wd_mult`` / ``lr_mult`` keys, which the scheduler multiplies in.
    A parameter shared between chunks appears once.
    """
    decay, no_decay, seen = [], [], set()
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "wd_mult": 1.0, "lr_mult": 1.0, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0, "weight_decay": 0.0})
    return groups


def _model_parallel_group():
    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_process_groups().model.size == 1:
        return None
    return parallel_state.get_model_parallel_group()


class MegatronOptimizer:
    """Base wrapper: owns the torch optimizer, the config and an optional grad scaler.

    Args:
        optimizer: a torch optimizer over the (main) parameters.
        config: the :class:`OptimizerConfig`.
        grad_scaler: None (fp32, bf16) or an fp16 loss scaler with ``scale``, ``inv_scale``,
            ``update(found_inf)``, ``state_dict()`` and ``load_state_dict()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, grad_scaler=None):
        self.optimizer = optimizer
        self.config = config
        self.grad_scaler = grad_scaler
        # Set by the training loop before step() when this rank's loss is inf/NaN: folded into the
        # step's one found-inf all-reduce, so every rank skips the iteration alike.
        self.nonfinite_loss = False

    def get_parameters(self) -> List[torch.nn.Parameter]:
        """The parameters the torch optimizer updates (the main params)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        return grads_for_norm(self.get_parameters())

    def get_grad_norm(self) -> float:
        """Global L2 norm of the main grads, each element of the model counted once."""
        return self._grad_norm_power().item() ** 0.5

    def _norm_data_parallel_group(self):
        """Group over which the norm's partial sums are also combined (None: grads not sharded)."""
        return None

    def _grad_norm_power(self) -> torch.Tensor:
        """Sum of squares of the main grads of the whole model: a 0-dim fp32 device tensor."""
        return grad_norm_power_fp32(self.get_main_grads_for_grad_norm(), 2.0,
                                    model_parallel_group=_model_parallel_group(),
                                    data_parallel_group=self._norm_data_parallel_group())

    def count_zeros(self) -> int:
        return count_zeros_fp32(self.get_parameters(), model_parallel_group=_model_parallel_group())

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

    def _norm_checks_grads(self) -> bool:
        """True when the step's gradient norm (clipping on, no loss scaler) tells whether a
        gradient is inf/NaN: the norm is then non-finite, and no separate pass over the
        gradients is needed (an fp32 sum of squares overflowing, at gradients above 1e19, counts
        as non-finite too)."""
        return self.grad_scaler is None and self.config.clip_grad > 0

    def _found_nonfinite(self, grads: List[torch.Tensor], inv_scale=None) -> bool:
        """:meth:`_nonfinite_flag` read on the host."""
        return bool(self._nonfinite_flag(grads, inv_scale).item() > 0)

    def _nonfinite_flag(self, grads: List[torch.Tensor], inv_scale=None) -> torch.Tensor:
        """Unscale ``grads`` in place (when ``inv_scale`` is given); a 0-dim fp32 device tensor,
        1 when any of them, or the loss of any rank (``nonfinite_loss``: a bool or a device
        tensor), is inf/NaN, else 0. The gradients themselves are left to the norm when
        :meth:`_norm_checks_grads`.

        Collective: all-reduce (max) of the flag over the model-parallel group, and over the
        data-parallel group when the main grads are DP shards (distributed optimizer).
        """
        device = grads[0].device if grads else torch.device("cpu")
        # Made on the device, never copied from the host: a host-to-GPU copy waits for the queue.
        found = torch.zeros((), dtype=torch.float32, device=device)
        flag, self.nonfinite_loss = self.nonfinite_loss, False
        if isinstance(flag, torch.Tensor):
            found = torch.maximum(found, flag.to(device=device, dtype=torch.float32).reshape(()))
        elif flag:
            found.fill_(1.0)
        if inv_scale is not None and grads:
            # The scaler's CPU scale as a number on the GPU (exact: the fp32 value), not a copy.
            factor = inv_scale.item() if device.type != inv_scale.device.type else inv_scale
            torch._foreach_mul_(grads, factor)
        if grads and not self._norm_checks_grads():
            # A sum is inf/NaN iff an element is (or the sum overflows fp32, i.e. the gradient is
            # past any useful range): one read pass, where isfinite().any() makes five.
            sums = torch.stack([g.sum(dtype=torch.float32) for g in grads])
            found = torch.maximum(found, (~torch.isfinite(sums)).any().float())
        dp_group = getattr(self, "_dp_group", lambda: None)()
        for group in (_model_parallel_group(), dp_group):
            if group is not None:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return found

    def _clip_count_and_step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """Clip, count zeros and step; ``(stepped, grad_norm, num_zeros)``. Nothing is stepped
        (``stepped`` False) when the gradient norm is inf/NaN (see :meth:`_norm_checks_grads`);
        the norm is identical on every rank, so every rank skips alike.

        With torch's fused AdamW the clipping is folded into the step: the kernel divides each
        gradient by ``grad_scale = 1 / clip_coeff`` as it reads it and writes the clipped value
        back, so the gradients end as clipping in place leaves them (within rounding: ``g / (1/c)``
        for ``g * c``) without a separate read-and-write pass over them. Zero counting
        (``log_num_zeros_in_grad``) counts the clipped gradients, so it keeps the separate pass.
        """
        grad_norm, clip_coeff = None, 1.0
        if self.config.clip_grad > 0:
            grad_norm = self.get_grad_norm()
            if not math.isfinite(grad_norm):
                return False, grad_norm, None
            clip_coeff = clip_coefficient(self.config.clip_grad, grad_norm)
        fold = clip_coeff < 1.0 and self._fused_step() and not self.config.log_num_zeros_in_grad
        if clip_coeff < 1.0 and not fold:
            grads = [g for g in (param_grad(p) for p in self.get_parameters()) if g is not None]
            clip_grads_by_total_norm(grads, self.config.clip_grad, grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        if fold:
            device = self.get_parameters()[0].device
            # Read by torch's fused Adam/AdamW step (the attribute GradScaler sets for it).
            self.optimizer.grad_scale = torch.tensor(1.0 / clip_coeff, dtype=torch.float32,
                                                     device=device)
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale
        else:
            self.optimizer.step()
        return True, grad_norm, num_zeros

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
        """True for the step without host syncs (:meth:`_step_on_device`): parameters on CUDA
        (on the CPU a host read waits for nothing) or ``device_side_step = True`` set on this
        object (tests), torch's fused AdamW, no zero counting (a count is a host read)."""
        forced = getattr(self, "device_side_step", None)
        params = self.get_parameters()
        on_device = forced if forced is not None else bool(params) and params[0].is_cuda
        return on_device and self._fused_step() and not self.config.log_num_zeros_in_grad

    def _step_on_device(self, grads: List[torch.Tensor], before_read=None
                        ) -> Tuple[bool, Optional[float], Optional[int]]:
        """Check, clip and step ``grads`` (the main grads) with nothing read on the host until
        the step's kernels are queued; ``(stepped, grad_norm, None)`` as the host path gives.

        The inf/NaN flag (:meth:`_nonfinite_flag`) and the clip factor stay device tensors
        handed to torch's fused kernel (``found_inf``: the kernel leaves parameters and moments
        untouched and takes its step count back; ``grad_scale = 1 / clip_coeff``, or 1 when the
        norm is within the clip). ``before_read()`` queues more work before the one host read
        (the flag and the squared norm together); the fp16 scaler is updated after it.
        """
        found = self._nonfinite_flag(
            grads, None if self.grad_scaler is None else self.grad_scaler.inv_scale)
        clip = self.config.clip_grad
        skip = found > 0
        total = torch.zeros_like(found)
        if clip > 0:
            total = self._grad_norm_power().to(found.device)
            skip = skip | ~torch.isfinite(total)
            inv_coeff = (total.double().sqrt() + 1.0e-6) / clip
            self.optimizer.grad_scale = torch.where(
                skip | (inv_coeff <= 1.0), torch.ones_like(inv_coeff), inv_coeff).float()
        self.optimizer.found_inf = skip.float()
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
            if clip > 0:
                del self.optimizer.grad_scale
        if before_read is not None:
            before_read()
        flagged, power = torch.stack([found, total.float()]).tolist()  # the step's one host read
        if self.grad_scaler is not None:
            self.grad_scaler.update(flagged > 0)
        grad_norm = power ** 0.5 if clip > 0 else None
        if flagged > 0:
            return False, None, None
        return grad_norm is None or math.isfinite(grad_norm), grad_norm, None

    def reload_model_params(self) -> None:
        """Refresh main params from the model params (after loading a model without optimizer)."""

    def step(self):  # pragma: no cover - abstract
        raise NotImplementedError


class FP32Optimizer(MegatronOptimizer):
    """fp32 model: the optimizer updates the model parameters with ``main_grad`` as gradient."""

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        params = self.get_parameters()
        for p in params:
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad  # a view: no copy
        grads = [p.grad for p in params if p.grad is not None]
        if self._steps_on_device():
            stepped, grad_norm, num_zeros = self._step_on_device(grads)
            found_inf = not stepped
        else:
            found_inf = self._found_nonfinite(
                grads, None if self.grad_scaler is None else self.grad_scaler.inv_scale)
            if self.grad_scaler is not None:
                self.grad_scaler.update(found_inf)
            grad_norm = num_zeros = None
            if not found_inf:
                stepped, grad_norm, num_zeros = self._clip_count_and_step()
                found_inf = not stepped
        for p in params:
            if getattr(p, "main_grad", None) is not None:
                # Drop the alias, or the next backward would accumulate into main_grad twice.
                p.grad = None
        return not found_inf, grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)


class MixedPrecisionOptimizer(MegatronOptimizer):
    """The mixed-precision step: model grads -> main grads, unscale/inf check, clip, step, copy back.

    Subclasses implement ``_main_grads()``, ``_copy_model_grads_to_main_grads()`` and
    ``_copy_main_params_to_model_params()``.
    """

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        """Unscale the main grads (fp16) and check them and the loss for inf/NaN (every dtype).
        Collective: see :meth:`MegatronOptimizer._found_nonfinite`."""
        return self._found_nonfinite(
            self._main_grads(), None if self.grad_scaler is None else self.grad_scaler.inv_scale)

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        self._copy_model_grads_to_main_grads()
        if self._steps_on_device():
            # Copied back unconditionally, before the host read: after a skipped step the main
            # params are unchanged and the copy rewrites the model params with their own values.
            return self._step_on_device(self._main_grads(),
                                        before_read=self._copy_main_params_to_model_params)
        # fp16 overflow, or inf/NaN in bf16: skip the iteration on every rank (nothing changes).
        found_inf = self._unscale_main_grads_and_check_for_nan()
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        if found_inf:
            return False, None, None
        stepped, grad_norm, num_zeros = self._clip_count_and_step()
        if stepped:
            self._copy_main_params_to_model_params()
        return stepped, grad_norm, num_zeros


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """bf16/fp16 model params with fp32 main params (Megatron's class of the same name).

    The torch optimizer's groups are rewritten in place: every bf16/fp16 param is replaced by an
    fp32 clone carrying the same parallel attributes; fp32 params stay as they are.

    Raises:
        TypeError: for a parameter that is neither fp32, bf16 nor fp16.
    """

    def __init__(self, optimizer, config, grad_scaler=None):
        super().__init__(optimizer, config, grad_scaler)
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

    def _pairs(self):
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            yield from zip(model_group, main_group)

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


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: List[torch.nn.Module],
                           grad_scaler=None) -> MegatronOptimizer:
    """Build AdamW over ``model_chunks`` wrapped for fp32 or bf16/fp16 training.

    AdamW runs fused (torch's fused kernel, CUDA and CPU); its ``lr`` and ``weight_decay``
    are rewritten every step by :class:`~megatron.core.optimizer.lr_scheduler.OptimizerParamScheduler`.

    Args:
        config: the :class:`OptimizerConfig`.
        model_chunks: the (DDP-wrapped) model chunks of this rank.
        grad_scaler: fp16 loss scaler; None builds the one of ``config`` for ``--fp16``
            (:func:`~megatron.core.optimizer.grad_scaler.build_grad_scaler`).

    With ``config.use_distributed_optimizer`` the result is a
    :class:`~megatron.core.optimizer.distrib_optimizer.DistributedOptimizer` (the chunks must be
    wrapped with ``use_distributed_optimizer=True``).

    Raises:
        ValueError: for invalid loss-scale settings, or chunks without a trainable parameter.
    """
    if config.fp16 and grad_scaler is None:
        from megatron.core.optimizer.grad_scaler import build_grad_scaler
        grad_scaler = build_grad_scaler(config)

    def make_adamw(groups):
        device = next((p.device for g in groups for p in g["params"]), torch.device("cpu"))
        # torch's fused AdamW (CUDA and CPU): one pass per parameter instead of about ten
        # element-wise passes (on CPU, foreach falls back to one kernel per op and tensor).
        kernel = {"fused": True} if device.type in ("cuda", "cpu") else {"foreach": True}
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                 eps=config.adam_eps, weight_decay=config.weight_decay, **kernel)

    if config.use_distributed_optimizer:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        return DistributedOptimizer(config, model_chunks, make_adamw, grad_scaler)
    groups = get_param_groups(model_chunks, config.weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    optimizer = make_adamw(groups)
    if config.bf16 or config.fp16:
        return Float16OptimizerWithFloat16Params(optimizer, config, grad_scaler)
    return FP32Optimizer(optimizer, config, grad_scaler)
