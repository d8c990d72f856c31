"""The LLaMA model (``LlamaModel``) and its pipeline-stage split (``get_layer_numbers``,
``get_virtual_layer_numbers``)."""

from __future__ import annotations

from typing import List


def unwrap_model(module):
    """The bare model under DDP / mixed-precision wrappers (each exposes ``.module``)."""
    while hasattr(module, "module"):
        module = module.module
    return module


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


def get_virtual_layer_numbers(num_layers: int, pipeline_size: int, pipeline_rank: int,
                              virtual_size: int, virtual_rank: int) -> List[int]:
    """Global 1-based layer numbers of model chunk ``virtual_rank`` on pipeline stage
    ``pipeline_rank`` with interleaving: the layers of virtual stage ``virtual_rank * PP +
    pipeline_rank``, each virtual stage a contiguous block of ``num_layers / (PP * v)`` layers
    (Megatron-LM's non-contiguous assignment, ``TransformerBlock``'s layer offset).

    Example: 8 layers, PP=2, v=2 -> stage 0: chunk 0 [1, 2], chunk 1 [5, 6];
    stage 1: chunk 0 [3, 4], chunk 1 [7, 8].

    Raises:
        ValueError: if ``num_layers`` is not divisible by ``pipeline_size * virtual_size`` or a
            rank is out of range.
    """
    if virtual_size < 1 or pipeline_size < 1 or num_layers % (pipeline_size * virtual_size):
        raise ValueError(f"--num-layers ({num_layers}) must be divisible by "
                         f"--pipeline-model-parallel-size ({pipeline_size}) x "
                         f"--virtual-pipeline-model-parallel-size ({virtual_size})")
    if not 0 <= pipeline_rank < pipeline_size:
        raise ValueError(f"pipeline rank {pipeline_rank} outside 0..{pipeline_size - 1}")
    if not 0 <= virtual_rank < virtual_size:
        raise ValueError(f"virtual pipeline rank {virtual_rank} outside 0..{virtual_size - 1}")
    # Virtual stage k = v * PP + p is stage k of a PP * v stage contiguous split.
    return get_layer_numbers(num_layers, pipeline_size * virtual_size,
                             virtual_rank * pipeline_size + pipeline_rank)


def __getattr__(name):
    # Lazy, so get_layer_numbers is usable (e.g. by argument validation) without building layers.
    if name == "LlamaModel":
        from megatron.model.llama import LlamaModel
        return LlamaModel
    raise AttributeError(name)


__all__ = ["LlamaModel", "get_layer_numbers", "get_virtual_layer_numbers"]
