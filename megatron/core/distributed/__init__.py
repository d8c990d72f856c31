"""Data parallelism: contiguous gradient buffers, buckets, the DDP wrapper, gradient finalisation."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer

__all__ = ["Bucket", "DistributedDataParallel", "ParamAndGradBuffer", "finalize_model_grads"]
