"""The parallel section of the configuration: the process layout and how gradients travel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ParallelConfig:
    """Process layout: ``world_size = TP x CP x PP x DP`` (Megatron-Core's rank order, see
    :mod:`megatron.core.process_groups`).

    Raises:
        ValueError: if TP x CP x PP x DP is not the world size.
    """

    world_size: int
    """Derived: processes of the job (torchrun's ``WORLD_SIZE``)."""
    tensor_model_parallel_size: int = 1
    """``--tensor-model-parallel-size``: TP. Default 1."""
    pipeline_model_parallel_size: int = 1
    """``--pipeline-model-parallel-size``: PP. Default 1."""
    context_parallel_size: int = 1
    """``--context-parallel-size``: CP, ranks one sequence is split over (the load-balanced causal
    split of :mod:`megatron.core.context_parallel`). Default 1."""
    data_parallel_size: int = 1
    """Derived: DP = world size / (TP x CP x PP), the one definition (validation computes it)."""
    expert_model_parallel_size: int = 1
    """``--expert-model-parallel-size``: EP, ranks the experts are split over (the expert grid
    of :mod:`megatron.core.process_groups`). Default 1."""
    expert_tensor_parallel_size: Optional[int] = None
    """``--expert-tensor-parallel-size``: expert-TP; None (the flag's default) is TP, which
    validation fills in."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """``--virtual-pipeline-model-parallel-size`` (or derived from
    ``--num-layers-per-virtual-pipeline-stage``): model chunks per pipeline rank, the interleaved
    schedule; None (the default) for plain 1F1B."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """``--num-layers-per-virtual-pipeline-stage``: layers of one model chunk with the interleaved
    schedule (filled in from the virtual size by validation); default None (no interleaving)."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: activations between the tensor-parallel blocks are
    ``[s/TP, b, h]`` (off at TP = 1). Default off."""
    distributed_backend: str = "gloo"
    """``--distributed-backend``: nccl or gloo; flag default nccl with CUDA, gloo on CPU."""
    distributed_timeout_minutes: float = 10.0
    """``--distributed-timeout-minutes``: collective timeout in minutes (fractions allowed).
    Default 10."""
    overlap_grad_reduce: bool = False
    """``--overlap-grad-reduce``: launch each gradient bucket's reduction from the backward pass.
    Default off."""
    overlap_param_gather: bool = False
    """``--overlap-param-gather``: with the distributed optimizer, wait for each bucket's
    parameter all-gather in the next forward. Default off."""
    reduce_bucket_size: Optional[float] = None
    """``--reduce-bucket-size``: gradient bucket size in elements; None (the default) is
    Megatron-Core's ``max(4e7, 1e6 x DP)``
    (:func:`megatron.core.distributed.param_and_grad_buffer.default_bucket_size`)."""
    data_parallel_sharding_strategy: str = "no_shard"
    """``--data-parallel-sharding-strategy``: ``no_shard`` (the default), ``optim`` (the
    distributed optimizer, ZeRO-1), ``optim_grads`` (and gradients, ZeRO-2),
    ``optim_grads_params`` (and parameters, ZeRO-3); see
    :mod:`megatron.core.distributed.param_units`."""
    accumulate_allreduce_grads_in_fp32: bool = True
    """``--no-accumulate-allreduce-grads-in-fp32`` turns it off (bf16 only): fp32 gradient
    buffers and reduction. Default on."""

    def __post_init__(self):
        product = (self.tensor_model_parallel_size * self.context_parallel_size
                   * self.pipeline_model_parallel_size * self.data_parallel_size)
        if product != self.world_size:
            raise ValueError(
                f"TP ({self.tensor_model_parallel_size}) x CP ({self.context_parallel_size}) x PP "
                f"({self.pipeline_model_parallel_size}) x DP ({self.data_parallel_size}) = "
                f"{product} != world size ({self.world_size})")
