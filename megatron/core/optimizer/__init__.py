"""Optimizer: AdamW wrappers with fp32 main params, global-norm clipping, the lr schedule."""

from megatron.core.optimizer.clip_grads import (clip_grad_norm_fp32, count_zeros_fp32,
                                                get_grad_norm_fp32, grads_for_norm)
from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler, build_opt_param_scheduler
from megatron.core.optimizer.optimizer import (Float16OptimizerWithFloat16Params, FP32Optimizer,
                                               MegatronOptimizer, MixedPrecisionOptimizer,
                                               OptimizerConfig, get_megatron_optimizer,
                                               get_param_groups)

__all__ = ["FP32Optimizer", "Float16OptimizerWithFloat16Params", "MegatronOptimizer",
           "MixedPrecisionOptimizer", "OptimizerConfig", "OptimizerParamScheduler", "build_opt_param_scheduler",
           "clip_grad_norm_fp32", "count_zeros_fp32", "get_grad_norm_fp32", "get_megatron_optimizer",
           "get_param_groups", "grads_for_norm"]
