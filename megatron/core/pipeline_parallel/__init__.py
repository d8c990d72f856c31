"""Pipeline parallelism: point-to-point communication and forward/backward schedules."""

from megatron.core.pipeline_parallel.schedules import (  # noqa: F401
    PipelineConfig,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)
