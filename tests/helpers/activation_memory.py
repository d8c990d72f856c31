"""Bytes of activations kept for backward, counted with ``torch.autograd.graph.saved_tensors_hooks``.

Each saved tensor is attributed to its storage; a storage counts once, with the size it has when
the forward has finished (so storages freed by ``CheckpointWithoutOutput`` count zero), and the
storages of the tensors named in ``exclude`` (parameters, and inputs shared by every layer like the
rotary tables) do not count.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def saved_activation_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()):
    """Run ``fn()`` and return ``(result, bytes kept for its backward)``."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in skip:
            kept.setdefault(storage._cdata, t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(t.untyped_storage().nbytes() for t in kept.values())
