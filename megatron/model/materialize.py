"""Models built on the meta device and then given real, uninitialised storage: the build of a
model whose weights a checkpoint will fill (``--load`` with a checkpoint, ``--finetune``), which
draws no random initial weights (for one 70B-shaped layer that draw alone costs seconds per rank
on the CPU; see ``benchmarks/startup.py``).
"""

from __future__ import annotations

import torch
from torch import nn


def is_meta(module: nn.Module) -> bool:
    """True if any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(module: nn.Module, device) -> nn.Module:
    """Give every meta parameter and buffer of ``module`` zero-filled storage on ``device``, in
    place; each new parameter keeps the old one's attributes (``tensor_model_parallel``,
    ``partition_dim``, ``shared_embedding``, ...) and ``requires_grad``, and a parameter shared by
    two modules stays shared. Zeros, not uninitialised memory: what a load leaves unfilled (the
    extra padding rows of the vocabulary when a distributed checkpoint was saved with another
    padding) must not be garbage; the fill costs one pass over the memory, no random draw.

    Returns:
        ``module``.
    """
    replaced: dict = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in replaced:
                new = nn.Parameter(torch.zeros(param.shape, dtype=param.dtype, device=device),
                                   requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                replaced[id(param)] = new
            sub._parameters[name] = replaced[id(param)]
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
    return module
