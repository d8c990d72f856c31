"""``--compile``: ``torch.compile`` of each transformer layer (off by default).

Compiling layer by layer (as torchtitan does) rather than the whole model keeps the pipeline
schedules, the DDP hooks and the loss outside the compiled graphs, and gives one graph reused by
every layer of the same shape. It pays on GPUs (fused element-wise kernels around the matrix
products); on CPUs the first steps pay the compilation and the gain is small.
"""

from __future__ import annotations

from typing import List

import torch

from megatron.model.transformer import TransformerLayer


def compile_transformer_layers(model_chunks: List[torch.nn.Module]) -> int:
    """``torch.compile`` every :class:`TransformerLayer` of ``model_chunks`` in place
    (``nn.Module.compile``: parameters, state-dict keys and hooks stay as they are).

    Returns:
        the number of layers compiled.
    """
    layers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)
