"""The LLaMA model (``LlamaModel``) and its pipeline-stage split (``get_layer_numbers``)."""

from __future__ import annotations

from typing import List


def get_layer_numbers(num_layers: int, pipeline_size: int, pipeline_rank: int) -> List[int]:
    """Global 1-based layer numbers held by a pipeline stage: a contiguous split, stage 0 first
    (Megatron-LM's ``get_num_layers`` / layer offset for the non-interleaved schedule).

    Example: 8 layers, PP=2 -> stage 0: [1..4], stage 1: [5..8].

    Raises:
        ValueError: if ``num_layers`` is not divisible by ``pipeline_size`` or the rank is outside
            ``0..pipeline_size-1``.
    """
    if pipeline_size < 1 or num_layers % pipeline_size:
        raise ValueError(f"--num-layers ({num_layers}) must be divisible by "
                         f"--pipeline-model-parallel-size ({pipeline_size})")
    if not 0 <= pipeline_rank < pipeline_size:
        raise ValueError(f"pipeline rank {pipeline_rank} outside 0..{pipeline_size - 1}")
    per_stage = num_layers // pipeline_size
    first = pipeline_rank * per_stage + 1
    return list(range(first, first + per_stage))


def __getattr__(name):
    # Lazy, so get_layer_numbers is usable (e.g. by argument validation) without building layers.
    if name == "LlamaModel":
        from megatron.model.llama import LlamaModel
        return LlamaModel
    raise AttributeError(name)


__all__ = ["LlamaModel", "get_layer_numbers"]
