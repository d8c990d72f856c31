"""Tensor parallelism: the f/g mappings, parallel layers, vocab-parallel cross entropy, RNG tracker.

See docs/architecture.md, "Tensor parallelism", for the contract.
"""

from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  VocabParallelEmbedding, linear_with_grad_accumulation)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region)
from megatron.core.tensor_parallel.utils import (
    VocabUtility, copy_tensor_model_parallel_attributes, divide,
    param_is_not_tensor_parallel_duplicate, set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes, split_tensor_along_last_dim)
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.random import (
    CheckpointFunction, CudaRNGStatesTracker, RNGStatesTracker, checkpoint, get_cuda_rng_tracker,
    get_rng_tracker, model_parallel_cuda_manual_seed, model_parallel_manual_seed)
