"""ZeRO-3 (``--data-parallel-sharding-strategy optim_grads_params``): parameters sharded over data
parallelism and all-gathered one unit at a time.

Design (Megatron-FSDP's, ``megatron/core/distributed/fsdp`` of Megatron-Core, re-built on our own
buffers). torch's FSDP2 (``fully_shard``) runs on CPU/gloo, but it does not serve here: it makes
every parameter a DTensor and reduce-scatters ``param.grad``, while our tensor-parallel layers
write their weight gradients straight into the fp32 ``param.main_grad`` buffer
(gradient-accumulation fusion) and hand autograd a placeholder, so FSDP2 would reduce the
placeholder; its per-parameter shards (dim-0 chunks of each tensor) would also replace the
contiguous bucket shards that the distributed optimizer's state, its checkpoints
(``parameter_state``: per name and element range, any DP size) and the memory formulas
(Megatron-FSDP's: bf16 params ``2 Psi / N`` + the gather window, grads ``4 Psi / N``, optimizer
``12 Psi / N``) are built on. So the DDP buffers themselves shard:

* a *unit* is one module of ``fsdp_unit_modules`` (the transformer layer, as Megatron-FSDP's
  default) or the *root unit*: every other parameter of the model chunk (embedding, final norm,
  output layer); a unit's parameters fill whole buckets of their own (the tied embedding at
  PP > 1 keeps its bucket of its own);
* each bucket keeps only this rank's ``param_shard`` (``shard_range(r)``, padding included) and
  its ``grad_shard``; the full parameter and gradient storage of a bucket exists only while its
  unit is in use;
* forward: a unit is all-gathered in its module's forward pre-hook (the root unit in the model's)
  and the next unit's all-gather is launched asynchronously (prefetch) before the unit computes;
  the unit is freed in its forward post-hook;
* backward: an autograd function on the unit's outputs all-gathers the unit again (and allocates
  its zeroed gradient storage) when the gradient of its output arrives, prefetching the unit
  before it; the unit is freed once every one of its parameters' gradients is final (the DDP
  post-accumulate-grad hook). Under full recompute the re-run forward, inside backward, gathers
  instead and keeps the unit;
* in every micro-batch, each bucket is reduce-scattered as soon as its gradients are final and
  the rank's part is added into its fp32 ``grad_shard``; its full gradient storage is freed
  then (under ``--overlap-grad-reduce`` when the next bucket's reduction is launched or the
  next unit's backward starts): a unit's full gradients live only during its own backward
  (the root unit's from the loss to the embedding), as in Megatron-FSDP (``optim_grads``
  reduce-scatters per micro-batch too). The reduction differs from the distributed
  optimizer's only in order (per micro-batch sums over ranks, then over micro-batches);
* outside its unit's forward and backward a parameter's storage is freed: it is a
  :class:`ShardedParameter`, whose reads raise :class:`ShardedParameterAccessError` (naming
  it and ``finish_param_sync()``) instead of reading freed memory;
* the optimizer steps the shards (:class:`~megatron.core.optimizer.DistributedOptimizer`, whose
  model shard is ``param_shard``); nothing is gathered after the step, the next forward does it.

Per micro-batch this is one all-gather of every parameter for forward, one for backward and one
reduce-scatter of every gradient. Reading the weights outside a
forward (saving, export) needs :meth:`ParamUnits.gather_all` on every data-parallel rank first
(``DistributedDataParallel.finish_param_sync`` calls it); each unit is freed again after its
next forward.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from megatron.core.distributed.param_and_grad_buffer import Bucket, allocated_bytes


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (a recompute's forward, say)."""
    return torch._C._current_graph_task_id() != -1


class ShardedParameterAccessError(RuntimeError):
    """A ZeRO-3 parameter was read while its full storage is freed (outside its unit's
    forward or backward, before ``finish_param_sync()``)."""


# Tensor methods and attributes that read no element: allowed on a freed parameter.
_METADATA = frozenset((
    "size", "dim", "numel", "nelement", "element_size", "untyped_storage", "data_ptr", "stride",
    "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "get_device",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "__len__",
    "__hash__", "_is_view"))
# Attributes that return a view of the freed storage (``data`` an alias, ``T`` / ``mT`` / ``H`` /
# ``mH`` transposes, ``real`` / ``imag``): the view is a plain tensor, so its later reads would
# escape the check and fail in torch ("setStorage: ... out of bounds").
_READING_ATTRIBUTES = frozenset(("data", "T", "mT", "H", "mH", "real", "imag"))


def _freed(t: torch.Tensor) -> bool:
    """Whether ``t`` has elements but its storage was released (``resize_(0)``)."""
    return bool(t.numel()) and t.untyped_storage().nbytes() == 0


def _get_main_grad(self):
    grad = self.__dict__.get("main_grad")
    if grad is None:
        raise AttributeError(f"{type(self).__name__} object has no attribute 'main_grad'")
    if _freed(grad):
        raise ShardedParameterAccessError(
            f"parameter {self.zero3_name!r}: main_grad is not held now: with sharded gradients "
            "(--data-parallel-sharding-strategy optim_grads or optim_grads_params) a bucket's full "
            "gradient lives only from its first gradient to its reduce-scatter; after "
            "finish_grad_sync() the rank's reduced part is DistributedDataParallel.reduced_grad(param)")
    return grad


def _set_main_grad(self, grad):
    self.__dict__["main_grad"] = grad


def _del_main_grad(self):
    self.__dict__.pop("main_grad", None)


class ShardedGradParameter(torch.nn.Parameter):
    """The class a parameter with sharded gradients (ZeRO-2 and ZeRO-3) is given (``__class__``
    swapped in place): its ``main_grad`` view's storage is freed between its bucket's
    reduce-scatter and its next gradient, so reading ``main_grad`` then raises
    :class:`ShardedParameterAccessError` naming the parameter instead of reading freed memory (a
    segfault). Everything else is a plain parameter's."""

    zero3_name = "?"
    main_grad = property(_get_main_grad, _set_main_grad, _del_main_grad)


def give_sharded_grad_class(params, names: Dict) -> None:
    """Swap each plain parameter of ``params`` to :class:`ShardedGradParameter`, named by
    ``names`` (``{param: name}``); a :class:`ShardedParameter` is one already."""
    for p in params:
        if type(p) is torch.nn.Parameter:
            p.__class__ = ShardedGradParameter
            p.zero3_name = names.get(p, "?")


class ShardedParameter(ShardedGradParameter):
    """The class a ZeRO-3 parameter is given (``__class__`` swapped in place, as torch's
    ``UninitializedParameter`` does): between its unit's uses its storage is freed, and an
    operation that would read it raises :class:`ShardedParameterAccessError` naming the
    parameter and the call that gathers it, instead of reading freed memory (a segfault).
    Metadata (shape, dtype, device, ``numel``, ...) stays readable; inside the gathered window
    every operation runs as on a plain parameter, returning plain tensors. Cost: one Python
    call and a storage-size check per operation on a parameter. ``as_subclass`` (which torch
    does not route through ``__torch_function__``) is checked too; torch's legacy
    ``torch.utils.dlpack.to_dlpack`` is a C function no Python class sees: use
    ``torch.from_dlpack`` / ``__dlpack__``, which are checked."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):
            attribute = getattr(func.__self__, "__name__", "")
            reads = name == "__get__" and attribute in _READING_ATTRIBUTES
        else:
            reads = name not in _METADATA
        with torch._C.DisableTorchFunctionSubclass():
            if reads:
                _check_gathered(args, kwargs, func)
            return func(*args, **(kwargs or {}))

    def as_subclass(self, cls):
        _check_gathered((self,), None, "as_subclass")
        return super().as_subclass(cls)


def _check_gathered(args, kwargs, func) -> None:
    items = list(args) + list((kwargs or {}).values())
    for a in items:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, ShardedParameter) and _freed(t):
                what = func if isinstance(func, str) else getattr(func, "__name__", str(func))
                if what == "__get__":
                    what = f"reading .{func.__self__.__name__}"
                raise ShardedParameterAccessError(
                    f"parameter {t.zero3_name!r} is sharded over data parallelism "
                    "(--data-parallel-sharding-strategy optim_grads_params) and not gathered "
                    f"now ({what}): outside its layer's forward and backward only the rank's "
                    "shard is held; call finish_param_sync() on the DistributedDataParallel "
                    "model on every data-parallel rank first (it gathers every unit; they are "
                    "freed again by the next forward)")


class _PreBackward(torch.autograd.Function):
    """Identity forward; backward prepares ``unit`` (gather, gradient storage) first."""

    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.prepare_backward()
        return (None, *grads)


class ParamUnit:
    """The buckets of one unit and its state in the current pass.

    Attributes:
        buckets: the unit's buckets (their params are the unit's).
        params: the unit's parameters.
        previous / next: the units before and after it in forward order (prefetch), or None.
    """

    def __init__(self, name: str, buckets: List[Bucket], owner: "ParamUnits"):
        self.name = name
        self.buckets = buckets
        self.params = [p for b in buckets for p in b.params]
        self.owner = owner
        self.previous = self.next = None
        self.waiting: set = set()
        self.backward_started = False

    def numel_padded(self) -> int:
        return sum(b.numel_padded for b in self.buckets)

    def gathered(self) -> bool:
        return all(b.params_gathered for b in self.buckets)

    def gather(self, async_op: bool = False) -> None:
        """All-gather the unit (no-op for a gathered one); wait unless ``async_op``."""
        for b in self.buckets:
            b.gather_params(async_op=True)
        if not async_op:
            for b in self.buckets:
                b.finish_param_sync()
        self.owner.note_gathered()

    def free(self) -> None:
        for b in self.buckets:
            b.free_params()
        self.backward_started = False

    def before_forward(self) -> None:
        if in_backward():  # a recompute: this is the unit's backward gather
            self.prepare_backward()
            return
        self.gather()
        if self.next is not None:
            self.next.gather(async_op=True)

    def after_forward(self, output):
        """Free the unit (not during a recompute) and hook its backward onto ``output``."""
        if not in_backward():
            self.free()
        if not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor):
            return _PreBackward.apply(self, output) if output.requires_grad else output
        if isinstance(output, tuple):
            idx = [i for i, t in enumerate(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
            if not idx:
                return output
            hooked = _PreBackward.apply(self, *[output[i] for i in idx])
            hooked = hooked if isinstance(hooked, tuple) else (hooked,)
            out = list(output)
            for i, t in zip(idx, hooked):
                out[i] = t
            return tuple(out)
        return output

    def prepare_backward(self) -> None:
        """Gather the unit and its zeroed gradient storage before its backward (once per
        backward), and prefetch the unit before it."""
        if self.backward_started:
            return
        self.backward_started = True
        self.owner.release_reduced_grads()
        self.gather()
        for b in self.buckets:
            b.allocate_grads()
        self.waiting = set(self.params)
        if self.previous is not None:
            self.previous.gather(async_op=True)

    def grad_ready(self, param) -> None:
        """``param``'s gradient of this backward is final: free the unit after its last one."""
        self.waiting.discard(param)
        if self.backward_started and not self.waiting:
            self.free()


class ParamUnits:
    """The units of one DDP-wrapped model chunk and their hooks (see the module docstring).

    Args:
        module: the wrapped model chunk.
        buffers: its :class:`~megatron.core.distributed.ParamAndGradBuffer` list, built with
            ``shard_params=True`` and the ``unit_of`` of :func:`unit_assignment`.
        unit_modules: the unit modules in forward order (the root unit is the rest).

    Attributes:
        units: root unit first, then one per unit module (forward order).
        peak_gathered_bytes: the most full-parameter bytes gathered at once since
            :meth:`reset_peak` (the gather window, measured).
    """

    def __init__(self, module: torch.nn.Module, buffers, unit_modules: Sequence[torch.nn.Module]):
        self.buffers = buffers
        buckets_of: Dict[int, List[Bucket]] = {}
        unit_of = unit_assignment(module, unit_modules)
        for buf in buffers:
            for b in buf.buckets:
                buckets_of.setdefault(unit_of[b.params[0]], []).append(b)
        names = ["root"] + [f"unit {i}" for i in range(len(unit_modules))]
        self.units = [ParamUnit(names[i], buckets_of.get(i, []), self)
                      for i in range(len(unit_modules) + 1)]
        self.param_unit = {p: u for u in self.units for p in u.params}
        param_names = {p: n for n, p in module.named_parameters()}
        for p in self.param_unit:  # a read outside the gathered window raises, never crashes
            p.__class__ = ShardedParameter
            p.zero3_name = param_names.get(p, "?")
        layers = self.units[1:]
        for a, b in zip(layers, layers[1:]):
            a.next, b.previous = b, a
        self.peak_gathered_bytes = 0
        self._handles = []
        for unit, m in zip(self.units, [module, *unit_modules]):
            self._handles.append(m.register_forward_pre_hook(
                lambda _m, _a, unit=unit: unit.before_forward()))
            self._handles.append(m.register_forward_hook(
                lambda _m, _a, out, unit=unit: unit.after_forward(out)))
        # (torch tags public hooks with an attribute: plain functions, not bound methods)
        self._handles.append(module.register_state_dict_post_hook(
            lambda *a: self._state_dict_hook(*a)))
        self._handles.append(module.register_load_state_dict_pre_hook(
            lambda *a: self._load_pre_hook(*a)))
        self._handles.append(module.register_load_state_dict_post_hook(
            lambda *a: self._load_post_hook(*a)))

    def gathered_bytes(self) -> int:
        return sum(allocated_bytes(b.param_data) for u in self.units for b in u.buckets)

    def note_gathered(self) -> None:
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def reset_peak(self) -> None:
        self.peak_gathered_bytes = self.gathered_bytes()

    def gather_all(self) -> None:
        """All-gather every unit (collective: every data-parallel rank must call it)."""
        for u in self.units:
            u.gather()

    def release_reduced_grads(self) -> None:
        """Complete the reduce-scatters still in flight (launched from the backward under
        --overlap-grad-reduce): the shard receives the result and the full gradient storage is
        freed. Called as each unit's backward starts, so at most the units still computing hold
        full gradients."""
        for u in self.units:
            for b in u.buckets:
                b.complete_grad_reduction()

    def free_all(self) -> None:
        for u in self.units:
            u.free()

    def grad_ready(self, param) -> None:
        self.param_unit[param].grad_ready(param)

    def _require_gathered(self, what: str) -> None:
        if not all(u.gathered() for u in self.units):
            raise RuntimeError(f"{what}: the parameters are sharded over data parallelism "
                               "(--data-parallel-sharding-strategy optim_grads_params); call "
                               "finish_param_sync() on every data-parallel rank first")

    def _state_dict_hook(self, _module, state_dict, _prefix, _metadata):
        self._require_gathered("state_dict()")
        for k, v in state_dict.items():  # own copies: the gathered storage is freed later
            if isinstance(v, torch.Tensor):
                state_dict[k] = v.clone()

    def _load_pre_hook(self, *_args):
        self._require_gathered("load_state_dict()")

    def reshard(self) -> None:
        """The gathered full parameters (just loaded) into the shards; then free them."""
        self._require_gathered("resharding")
        with torch.no_grad():
            for u in self.units:
                for b in u.buckets:
                    b.write_shard_from_params()
        self.free_all()

    def _load_post_hook(self, _module, _incompatible):
        self.reshard()


def unit_assignment(module: torch.nn.Module,
                    unit_modules: Sequence[torch.nn.Module]) -> Dict[torch.nn.Parameter, int]:
    """``param -> unit``: 1 + the index of the first unit module holding it, 0 for the rest."""
    unit_of = {}
    for i, m in enumerate(unit_modules):
        for p in m.parameters():
            unit_of.setdefault(p, i + 1)
    for p in module.parameters():
        unit_of.setdefault(p, 0)
    return unit_of


def order_by_unit(params: List[torch.nn.Parameter], unit_of) -> List[torch.nn.Parameter]:
    """``params`` unit by unit (stable), the root unit first: the buffer lays them out reversed,
    so the last unit's buckets come first, as its gradients do in backward."""
    return sorted(params, key=lambda p: unit_of[p])
