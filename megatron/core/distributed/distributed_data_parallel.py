"""Data-parallel wrapper with contiguous ``main_grad`` buffers and bucketed gradient all-reduce.

After Megatron-Core's ``DistributedDataParallel``: every parameter gets ``param.main_grad``, a view
into one contiguous buffer per dtype pair (fp32 by default); a post-accumulate-grad hook adds
``param.grad`` into ``main_grad`` and frees ``param.grad``, so gradients accumulate over micro-batches
in the buffer (in fp32 for bf16 models). Layers with gradient-accumulation fusion write their weight
gradients into ``main_grad`` themselves and hand autograd a placeholder flagged
``grad_added_to_main_grad``, which the hook drops (see ``tensor_parallel/grad_accumulation.py``).
``finish_grad_sync()`` all-reduces the buckets over the data-parallel group.

Averaging: each bucket is multiplied by ``1 / DP`` *before* a sum all-reduce (Megatron-Core's
``gradient_scaling_factor``), or reduced with ``ReduceOp.AVG`` when ``average_in_collective=True``
(NCCL only). Either way ``main_grad`` ends as the mean over data-parallel ranks of the per-rank
gradient sums over micro-batches.

Plural buffers (Megatron-Core's): one buffer per (param dtype, grad dtype, replica group). Expert
parameters (:func:`~megatron.core.distributed.expert_params.is_expert_param`) get buffers of
their own, reduced over the expert-data-parallel group (``expt_dp``) and scaled by ``1 / DP``
too (Megatron-Core's ``expert_gradient_scaling_factor``: an expert's gradient sums the tokens
that every rank of the data x context group routed to it; with ``ReduceOp.AVG`` the buffer is
pre-scaled by ``expert-DP / DP``). At EP = 1 ``expt_dp`` has the ranks of ``dp_cp``: the
expert buffers reduce exactly as the dense ones would.

Typical iteration::

    model.zero_grad_buffer()
    with model.no_sync():
        for mb in micro_batches[:-1]:
            loss(model(mb)).backward()
    loss(model(micro_batches[-1])).backward()  # with overlap_grad_reduce, buckets launch here
    model.finish_grad_sync()                      # (usually through finalize_model_grads)
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.distributed.expert_params import is_expert_param
from megatron.core.distributed.param_and_grad_buffer import (GradStorageMeter, ParamAndGradBuffer,
                                                            allocated_bytes, default_bucket_size)
from megatron.core.distributed.param_units import (ParamUnits, give_sharded_grad_class, order_by_unit,
                                                   unit_assignment)
from megatron.core.process_groups import group_size


# Megatron-Core's --data-parallel-sharding-strategy choices.
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")

def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """The module a :class:`DistributedDataParallel` chunk wraps; a plain module itself."""
    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


# expert_data_parallel_group not given: refused when expert parameters exist and DP > 1.
_NOT_GIVEN = object()


def _release_params(handles, params) -> None:
    """When a wrapper is collected: remove its gradient hooks and the ``main_grad`` views of its
    buffers from the parameters (those that hold it as a plain attribute)."""
    for handle in handles:
        handle.remove()
    for p in params:
        if "main_grad" in vars(p):
            del p.main_grad


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` for data parallelism over ``data_parallel_group``.

    Args:
        module: the model chunk; its parameters with ``requires_grad`` get ``main_grad``.
        data_parallel_group: process group the gradients are reduced over (the data x context
            parallel group ``ProcessGroupCollection.dp_cp``), or None for a world of one.
        accumulate_allreduce_grads_in_fp32: keep gradient buffers in fp32 whatever the param dtype
            (``--accumulate-allreduce-grads-in-fp32``); else the buffer dtype is the param dtype.
        bucket_size: elements per bucket (``--reduce-bucket-size``); None means Megatron's default
            (:func:`~megatron.core.distributed.param_and_grad_buffer.default_bucket_size`:
            ``max(40e6, 1e6 * DP)`` elements, i.e. one bucket for small models).
        average_in_collective: average with ``ReduceOp.AVG`` (NCCL only) instead of scaling by
            ``1/DP`` before a sum all-reduce.
        overlap_grad_reduce: launch a bucket's all-reduce asynchronously from the backward pass as
            soon as all its gradients of the last micro-batch are final (``--overlap-grad-reduce``).
        use_distributed_optimizer: move parameters into contiguous buffers (``param.data``
            becomes a view) and reduce-scatter the buckets instead of all-reducing them: each
            data-parallel rank ends with the reduced gradient of its shard of every bucket only.
        overlap_param_gather: with the distributed optimizer, the parameter all-gathers launched
            after the step (:meth:`start_param_sync`) are waited on in forward pre-hooks, just
            before the first module using a bucket (``--overlap-param-gather``).
        data_parallel_sharding_strategy: with the distributed optimizer, what else is sharded
            over data parallelism (``--data-parallel-sharding-strategy``, Megatron-FSDP's
            names): ``optim`` (the optimizer state only, ZeRO-1), ``optim_grads`` (and the
            gradients, ZeRO-2: in every micro-batch each bucket is reduce-scattered as soon as
            its gradients are final and added into its fp32 ``grad_shard``; its full storage
            exists only from its first gradient to that reduce-scatter, ``grad_meter`` measures
            it),
            ``optim_grads_params`` (and the parameters, gathered per unit:
            :mod:`~megatron.core.distributed.param_units`, ZeRO-3). ``no_shard``: plain.
        fsdp_unit_modules: module classes whose instances are ZeRO-3 units (the transformer
            layer); every other parameter is the root unit. None: the root unit only.
        expert_data_parallel_group: the group expert parameters' gradients reduce over
            (``ProcessGroupCollection.expt_dp``; None for a group of one). Needed only when the
            module has expert parameters.

    Attributes:
        buffers: one :class:`ParamAndGradBuffer` per (param dtype, grad dtype, replica group);
            each has ``is_expert``, its ``data_parallel_group`` and ``gradient_scaling_factor``.

    Raises:
        ValueError: if ``average_in_collective`` is asked on a backend without ``ReduceOp.AVG``;
            an unknown strategy, a sharding strategy without the distributed optimizer, or
            ``overlap_param_gather`` with sharded parameters (the forward gathers them);
            expert parameters without ``expert_data_parallel_group`` (at DP > 1).
    """

    def __init__(self, module: torch.nn.Module, *, data_parallel_group,
                 accumulate_allreduce_grads_in_fp32: bool = True,
                 bucket_size: Optional[int] = None, average_in_collective: bool = False,
                 overlap_grad_reduce: bool = False, use_distributed_optimizer: bool = False,
                 overlap_param_gather: bool = False,
                 data_parallel_sharding_strategy: str = "optim",
                 fsdp_unit_modules: Optional[Sequence[type]] = None,
                 expert_data_parallel_group=_NOT_GIVEN):
        super().__init__()
        self.module = module
        self.data_parallel_group = data_parallel_group
        dp = group_size(data_parallel_group)
        self.data_parallel_world_size = dp
        if average_in_collective and data_parallel_group is not None and \
                dist.get_backend(data_parallel_group) == "gloo":
            raise ValueError("average_in_collective=True needs ReduceOp.AVG, which the gloo backend "
                             "lacks; leave it False (gradients are then scaled by 1/DP before the "
                             "all-reduce)")
        if bucket_size is None:
            bucket_size = default_bucket_size(dp)
        bucket_size = int(bucket_size)
        if bucket_size <= 0:
            raise ValueError(f"--reduce-bucket-size ({bucket_size}) must be a positive number of "
                             "elements")
        self.bucket_size = bucket_size
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        if overlap_param_gather and not use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
        self.overlap_param_gather = overlap_param_gather
        strategy = data_parallel_sharding_strategy
        if strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"data_parallel_sharding_strategy ({strategy!r}) must be one of "
                             f"{', '.join(SHARDING_STRATEGIES)}")
        if strategy in ("optim_grads", "optim_grads_params") and not use_distributed_optimizer:
            raise ValueError(f"data_parallel_sharding_strategy {strategy} needs "
                             "use_distributed_optimizer=True")
        shard_grads = strategy in ("optim_grads", "optim_grads_params")
        shard_params = strategy == "optim_grads_params"
        if shard_params and overlap_param_gather:
            raise ValueError("--overlap-param-gather does not apply to "
                             "--data-parallel-sharding-strategy optim_grads_params: its forward "
                             "gathers each unit itself (with prefetch); drop the flag")
        self.data_parallel_sharding_strategy = strategy
        # Buckets already launched when the last gradient of the backward arrived (benchmark).
        self.launched_before_last_grad = 0
        self.accumulate_allreduce_grads_in_fp32 = accumulate_allreduce_grads_in_fp32
        # The averaging every buffer ends with (dense or expert, pre-scaled or AVG): undone by
        # divide_gradients_by_tokens for per-token loss.
        self.gradient_scaling_factor = 1.0 / dp
        self.is_last_microbatch = True

        groups: Dict[Tuple[torch.dtype, torch.dtype, bool], list] = {}
        for p in module.parameters():
            if not p.requires_grad:
                continue
            grad_dtype = torch.float32 if accumulate_allreduce_grads_in_fp32 else p.dtype
            groups.setdefault((p.dtype, grad_dtype, is_expert_param(p)), []).append(p)
        has_experts = any(expert for _, _, expert in groups)
        if expert_data_parallel_group is _NOT_GIVEN:
            if has_experts and dp > 1:
                raise ValueError("the module has expert parameters (allreduce=False): give "
                                 "expert_data_parallel_group (ProcessGroupCollection.expt_dp)")
            expert_data_parallel_group = data_parallel_group
        self.expert_data_parallel_group = expert_data_parallel_group
        unit_modules, unit_of = [], None
        if shard_params:
            kinds = tuple(fsdp_unit_modules or ())
            unit_modules = [m for m in module.modules() if kinds and isinstance(m, kinds)]
            unit_of = unit_assignment(module, unit_modules)
            groups = {k: order_by_unit(v, unit_of) for k, v in groups.items()}
        expert_dp = group_size(expert_data_parallel_group)

        def scaling(expert: bool) -> float:
            # Megatron-Core's: 1/DP for both; ReduceOp.AVG divides an expert buffer by expert-DP.
            if average_in_collective:
                return expert_dp / dp if expert else 1.0
            return 1.0 / dp

        self.buffers = [
            ParamAndGradBuffer(params, grad_dtype,
                               expert_data_parallel_group if expert else data_parallel_group,
                               bucket_size, gradient_scaling_factor=scaling(expert),
                               use_avg_op=average_in_collective,
                               use_param_buffer=use_distributed_optimizer,
                               reduce_scatter=use_distributed_optimizer,
                               shard_grads=shard_grads, shard_params=shard_params,
                               unit_of=unit_of, is_expert=expert)
            for (_, grad_dtype, expert), params in groups.items()]
        self.param_to_buffer = {p: buf for buf in self.buffers for p in buf.params}
        self.param_units = (ParamUnits(module, self.buffers, unit_modules) if shard_params
                            else None)
        self.shard_grads = shard_grads
        self._setup_sharded_grads()

        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook())
                              for p in self.param_to_buffer]
        # A wrapper dropped while its module lives on leaves a plain module: autograd's .grad
        # again, no main_grad of a buffer nothing zeroes or reduces any more.
        weakref.finalize(self, _release_params, list(self._hook_handles), list(self.param_to_buffer))
        if overlap_param_gather:
            self._register_param_gather_hooks()

    def _register_param_gather_hooks(self) -> None:
        """Forward pre-hooks that wait for the all-gathers of a module's own parameters.

        A parameter used outside its module's forward (the last stage's tied embedding copy,
        read by the parent) would never trigger its module's hook: after the first forward, the
        buckets of modules that were not called are waited on by the root module's pre-hook.
        """
        buckets_of = {}
        for m in self.module.modules():
            owned = [self.param_to_buffer[p].param_to_bucket[p]
                     for p in m.parameters(recurse=False) if p in self.param_to_buffer]
            if owned:
                buckets_of[m] = list(dict.fromkeys(owned))
        called, self._root_buckets = set(), None

        def wait_for(buckets):
            for b in buckets:
                b.finish_param_sync()

        def pre_hook(module, _args):
            if self._root_buckets is None:
                called.add(module)
            wait_for(buckets_of.get(module, ()))

        def root_pre_hook(module, _args):
            wait_for(self._root_buckets or ())

        def root_post_hook(module, _args, _out):
            if self._root_buckets is None:
                self._root_buckets = [b for m, bs in buckets_of.items() if m not in called
                                      for b in bs]

        self._hook_handles.append(self.module.register_forward_pre_hook(root_pre_hook))
        for m in buckets_of:
            self._hook_handles.append(m.register_forward_pre_hook(pre_hook))
        self._hook_handles.append(self.module.register_forward_hook(root_post_hook))

    def _setup_sharded_grads(self) -> None:
        """The gradient meter; with sharded gradients each parameter's ``allocate_main_grad``
        (the layers' gradient-accumulation fusion calls it before writing ``main_grad``, whose
        storage is freed between a bucket's reduce-scatter and its next gradient)."""
        self._bucket_of = {p: buf.param_to_bucket[p] for buf in self.buffers for p in buf.params}
        self._grads_in_flight = []
        mem = self.memory_bytes()
        self.grad_meter = GradStorageMeter(mem["grads"] + mem["grad_shards"])
        for bucket in set(self._bucket_of.values()):
            bucket.grad_meter = self.grad_meter
        if self.shard_grads:
            for p, bucket in self._bucket_of.items():
                p.allocate_main_grad = bucket.allocate_grads
            # Reading main_grad while its storage is freed raises instead of crashing.
            give_sharded_grad_class(self._bucket_of, {p: n for n, p in self.module.named_parameters()})

    def _sharded_grad_ready(self, param: torch.nn.Parameter) -> None:
        """ZeRO-2/3, every micro-batch: once every gradient of ``param``'s bucket is final, the
        bucket is reduce-scattered into its shard and its full storage freed (asynchronously
        under ``--overlap-grad-reduce``: then at most one bucket's reduction is in flight; the
        previous one is completed first)."""
        bucket = self._bucket_of[param]
        bucket.params_with_grad.add(param)
        if len(bucket.params_with_grad) < len(bucket.params):
            return
        for b in self._grads_in_flight:
            b.complete_grad_reduction()
        bucket.reduce_scatter_into_shard(async_op=self.overlap_grad_reduce)
        self._grads_in_flight = [bucket] if bucket.handle is not None else []

    def _make_hook(self):
        # The hook lives on the parameter (held by autograd's C++ side, out of the garbage
        # collector's sight): a strong reference to this wrapper would keep the model, its
        # buffers and process groups alive after training, in every process that trains twice.
        this = weakref.ref(self)

        def hook(param: torch.nn.Parameter) -> None:
            self = this()
            if self is None:
                return
            # post-accumulate hooks run once per backward after every use of the param (tied
            # weights included), so param.grad is the param's full gradient of this backward.
            if param.grad is not None:
                if getattr(param, "grad_added_to_main_grad", False):
                    # Gradient-accumulation fusion already wrote main_grad; .grad is a placeholder.
                    param.grad_added_to_main_grad = False
                else:
                    if self.shard_grads:
                        self._bucket_of[param].allocate_grads()
                    param.main_grad.add_(param.grad)
                param.grad = None
            if self.param_units is not None:
                self.param_units.grad_ready(param)
            if self.shard_grads:
                self._sharded_grad_ready(param)
                return
            if self.overlap_grad_reduce and self.is_last_microbatch:
                self.launched_before_last_grad = sum(
                    b.launched for buf in self.buffers for b in buf.buckets)
                self.param_to_buffer[param].register_grad_ready(param, async_op=True)
        return hook

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def __getattr__(self, name):
        # Let callers reach the wrapped model's methods (set_input_tensor, ...) through the wrapper.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    @contextlib.contextmanager
    def no_sync(self):
        """Context for the micro-batches before the last: no bucket is launched from backward
        (no effect with sharded gradients, which are reduce-scattered in every micro-batch)."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (start of an iteration) and drop any leftover ``param.grad``."""
        for p in self.param_to_buffer:
            p.grad = None
        for buf in self.buffers:
            buf.reset()

    def start_grad_sync(self) -> None:
        """Launch every bucket's all-reduce not launched yet (asynchronously under overlap)."""
        for buf in self.buffers:
            buf.start_grad_sync(async_op=self.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """Complete the data-parallel reduction: ``main_grad`` holds the DP-averaged gradient."""
        for buf in self.buffers:
            buf.finish_grad_sync()
        self._grads_in_flight = []
        if self.param_units is not None:  # units whose gradients did not all arrive
            self.param_units.free_all()

    def reduced_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s gradient as the reduction left it: ``main_grad``, or with sharded
        gradients (after :meth:`finish_grad_sync`) the flat view of the rank's ``grad_shard``
        that belongs to ``param`` (possibly empty)."""
        buf = self.param_to_buffer[param]
        bucket = buf.param_to_bucket[param]
        if not bucket.shard_grads:
            return param.main_grad
        start, end, _ = buf.param_index_map[param]
        s, e = bucket.shard_range(bucket.data_parallel_rank)
        lo, hi = bucket.offset + s, bucket.offset + e
        a, b = max(start, lo), min(end, hi)
        return bucket.grad_shard[a - lo:max(a, b) - lo]

    def start_param_sync(self, expert: Optional[bool] = None) -> None:
        """Launch the all-gather of every bucket's updated parameter shards (distributed
        optimizer), asynchronously under ``overlap_param_gather``, else completed here; with
        ``expert`` True or False only the expert or the dense buffers' (each optimizer part
        gathers what it stepped). Nothing with sharded parameters: the next forward gathers
        each unit."""
        if self.param_units is not None:
            return
        for buf in self.buffers:
            if expert is None or buf.is_expert == expert:
                buf.start_param_sync(async_op=self.overlap_param_gather)
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Complete every pending parameter all-gather: call before anything reads the weights
        outside a forward (evaluation, checkpoint saving, export). With sharded parameters
        this all-gathers every unit (a collective: call it on every data-parallel rank); each
        unit is freed again after its next forward, or by a ``load_state_dict``."""
        self.wait_param_sync()
        if self.param_units is not None:
            self.param_units.gather_all()

    def reshard_params(self) -> None:
        """Sharded parameters: copy the (gathered, just loaded) full parameters into the shards
        and free them; nothing otherwise."""
        if self.param_units is not None:
            self.param_units.reshard()

    def wait_param_sync(self) -> None:
        """Wait for the parameter all-gathers in flight (never starts one)."""
        for buf in self.buffers:
            buf.finish_param_sync()

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds now, from the storages themselves: ``param_shards`` (the
        sharded parameters' ``param_shard``; 0 unless ZeRO-3), ``params`` (full parameter
        storage: the whole model, or ZeRO-3's gathered units), ``grad_shards`` (ZeRO-2/3's
        ``grad_shard``), ``grads`` (full gradient storage)."""
        out = dict.fromkeys(("param_shards", "params", "grad_shards", "grads"), 0)
        for buf in self.buffers:
            for b in buf.buckets:
                if b.shard_params:
                    out["param_shards"] += allocated_bytes(b.param_shard)
                if b.shard_grads:
                    out["grad_shards"] += allocated_bytes(b.grad_shard)
                out["grads"] += allocated_bytes(b.grad_data) if buf.sharded else 0
                out["params"] += allocated_bytes(b.param_data) if buf.sharded else 0
            if not buf.sharded:
                out["grads"] += allocated_bytes(buf.grad_data)
                out["params"] += (allocated_bytes(buf.param_data) if buf.param_data is not None
                                  else sum(allocated_bytes(p.data) for p in buf.params))
        return out

    def param_gathers_in_flight(self) -> int:
        """Number of bucket all-gathers launched and not yet completed."""
        return sum(b.param_sync_pending() for buf in self.buffers for b in buf.buckets)

    def scale_gradients(self, factor: float) -> None:
        """Multiply every ``main_grad`` by ``factor``."""
        for buf in self.buffers:
            buf.scale_gradients(factor)

    def divide_gradients_by_tokens(self, total_tokens: float) -> None:
        """Per-token loss: undo the averaging (``1 / DP`` for every buffer, dense or expert,
        whether applied before the sum or by ``ReduceOp.AVG``) and divide by ``total_tokens``
        (the loss tokens of the whole global batch), so ``main_grad`` ends as the sum over
        ranks divided by the token count."""
        self.scale_gradients(1.0 / (self.gradient_scaling_factor * total_tokens))

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)
