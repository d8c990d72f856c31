"""Optimizer: AdamW wrappers with fp32 main params, global-norm clipping, the lr schedule, and the
factory that picks one (:func:`get_megatron_optimizer`, Megatron-Core's, in this file so that the
optimizer classes import nothing that imports them back)."""

from __future__ import annotations

from typing import List

import torch

from megatron.core.optimizer.clip_grads import (clip_grad_norm_fp32, count_zeros_fp32,
                                                get_grad_norm_fp32, grads_for_norm)
from megatron.core.optimizer.chained_optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import build_grad_scaler
from megatron.core.optimizer.lr_scheduler import (OptimizerParamScheduler, build_opt_param_scheduler,
                                                  lr_schedule_steps)
from megatron.core.optimizer.optimizer import (Float16OptimizerWithFloat16Params, FP32Optimizer,
                                               MegatronOptimizer, MixedPrecisionOptimizer)
from megatron.core.optimizer.optimizer_config import OptimizerConfig, SchedulerConfig
from megatron.core.optimizer.param_groups import get_param_groups
from megatron.core.process_groups import ProcessGroupCollection

__all__ = ["ChainedOptimizer", "DistributedOptimizer", "FP32Optimizer", "Float16OptimizerWithFloat16Params",
           "MegatronOptimizer", "MixedPrecisionOptimizer", "OptimizerConfig",
           "OptimizerParamScheduler", "SchedulerConfig", "build_opt_param_scheduler",
           "clip_grad_norm_fp32", "lr_schedule_steps",
           "count_zeros_fp32", "get_grad_norm_fp32", "get_megatron_optimizer", "get_param_groups",
           "grads_for_norm"]


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: List[torch.nn.Module], *,
                           pg_collection: ProcessGroupCollection,
                           grad_scaler=None) -> MegatronOptimizer:
    """Build AdamW over ``model_chunks`` wrapped for fp32 or bf16/fp16 training.

    AdamW runs fused (torch's fused kernel, CUDA and CPU); its ``lr`` and ``weight_decay``
    are rewritten every step by :class:`~megatron.core.optimizer.lr_scheduler.OptimizerParamScheduler`.

    Args:
        config: the :class:`OptimizerConfig`.
        model_chunks: the (DDP-wrapped) model chunks of this rank.
        pg_collection: this rank's process groups; the distributed optimizer shards over its
            ``dp_cp`` group (the group the chunks' buffers were built over).
        grad_scaler: fp16 loss scaler; None builds the one of ``config`` for ``--fp16``
            (:func:`~megatron.core.optimizer.grad_scaler.build_grad_scaler`).

    With ``config.use_distributed_optimizer`` the result is a :class:`DistributedOptimizer` (the
    chunks must be wrapped with ``use_distributed_optimizer=True``). A model with expert
    parameters (``allreduce = False``) gets a :class:`ChainedOptimizer` of a dense part
    (sharded over ``dp_cp``) and an expert part (sharded over ``expt_dp``, its norm summed over
    ``tp_ep_pp``).

    Raises:
        ValueError: for invalid loss-scale settings, or chunks without a trainable parameter.
    """
    if config.fp16 and grad_scaler is None:
        grad_scaler = build_grad_scaler(config)

    def make_adamw(groups):
        # An empty expert part (a pipeline stage without MoE layers) holds one empty group.
        groups = groups or [{"params": []}]
        device = next((p.device for g in groups for p in g["params"]), torch.device("cpu"))
        # torch's fused AdamW (CUDA and CPU): one pass per parameter instead of about ten
        # element-wise passes (on CPU, foreach falls back to one kernel per op and tensor).
        kernel = {"fused": True} if device.type in ("cuda", "cpu") else {"foreach": True}
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                 eps=config.adam_eps, weight_decay=config.weight_decay, **kernel)

    has_experts = _model_has_experts(model_chunks, config, pg_collection)

    def part(expert):
        """The optimizer of the dense (``expert`` False) or the expert parameters (None: all,
        the one optimizer of a model without experts)."""
        if config.use_distributed_optimizer:
            group = pg_collection.expt_dp if expert else pg_collection.dp_cp
            return DistributedOptimizer(config, model_chunks, make_adamw, grad_scaler,
                                        pg_collection=pg_collection,
                                        data_parallel_group=group.group, expert=bool(expert))
        groups = get_param_groups(model_chunks, config.weight_decay, expert)
        if not groups and not expert:
            raise ValueError("the model has no trainable parameters")
        if config.bf16 or config.fp16:
            return Float16OptimizerWithFloat16Params(make_adamw(groups), config, grad_scaler,
                                                     pg_collection=pg_collection,
                                                     expert=bool(expert))
        return FP32Optimizer(make_adamw(groups), config, grad_scaler,
                             pg_collection=pg_collection, expert=bool(expert))

    if not has_experts:
        return part(None)
    dense = [part(False)] if get_param_groups(model_chunks, config.weight_decay, False) else []
    return ChainedOptimizer(dense + [part(True)])


def _model_has_experts(model_chunks, config, pg_collection) -> bool:
    """Whether any pipeline stage holds expert parameters. A stage without MoE layers (e.g.
    ``--moe-layer-freq [0,0,1,1]`` at PP = 2) still builds an (empty) expert part, because the
    expert part's skip flag and norm are reduced over ``tp_ep_pp``, which spans the stages: a
    stage that skipped them would hang the others and miss their expert norm."""
    local = bool(get_param_groups(model_chunks, config.weight_decay, expert=True))
    pp = pg_collection.pp
    if pp.size == 1:
        return local
    device = next((p.device for chunk in model_chunks for p in chunk.parameters()),
                  torch.device("cpu"))
    flag = torch.tensor([float(local)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=pp.group)
    return bool(flag.item())
