"""The random-number generators' states a checkpoint stores (Megatron-LM's ``rng_state``:
Python, NumPy, torch, CUDA and the model-parallel tracker), as ``weights_only``-safe values."""

from __future__ import annotations

import random

import numpy as np
import torch


def get_rng_state() -> dict:
    """Python, NumPy, torch, CUDA and model-parallel tracker states, as weights_only-safe values."""
    from megatron.core.tensor_parallel.random import get_rng_tracker

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": get_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`get_rng_state` returned."""
    from megatron.core.tensor_parallel.random import get_rng_tracker

    version, internal, gauss = state["random_rng_state"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, g = state["np_rng_state"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, g))
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_rng_tracker().set_states(state["rng_tracker_states"])
