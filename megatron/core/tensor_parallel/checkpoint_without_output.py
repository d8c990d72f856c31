"""Recompute a function in backward without keeping its output either (Megatron-Core's
``CheckpointWithoutOutput``, ``megatron/core/tensor_parallel/random.py``).

``tensor_parallel.checkpoint`` keeps a function's inputs and drops what the function saves
inside; its output stays alive as long as a consumer saves it. For the cheap functions of selective
recompute (a norm, the SwiGLU activation, the attention core), the output is exactly what the next
linear layer saves for its weight gradient, so a plain checkpoint saves nothing. This class also
frees the output's storage once the consumer has run, and refills it (same storage, so the
consumer's saved tensor sees the data again) from a hook that fires when backward reaches the
consumer's output, before the consumer's own backward reads it.

Usage::

    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(norm, x)              # runs norm(x) without autograd graph
    z = linear(y)                             # linear saves y
    ckpt.discard_output_and_register_recompute(z)   # frees y; recomputes it when dz is known

Random numbers (CPU, CUDA and every tracker state) are replayed as in ``checkpoint``, so dropout
inside the function draws the same masks.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.tensor_parallel.random import (get_device_rng_states, get_rng_tracker,
                                                  set_device_rng_states)


def _as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, checkpointer, *args):
        checkpointer.ctx = ctx
        checkpointer.non_tensor_args = {i: a for i, a in enumerate(args) if not torch.is_tensor(a)}
        checkpointer.num_args = len(args)
        ctx.checkpointer = checkpointer
        ctx.save_for_backward(*(a for a in args if torch.is_tensor(a)))
        with torch.no_grad():
            return checkpointer.run_function(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        checkpointer = ctx.checkpointer
        if checkpointer.recomputed is None:  # output kept (no discard): recompute now
            checkpointer.recompute()
        inputs, outputs = checkpointer.recomputed
        checkpointer.recomputed = None
        checkpointer.ctx = None  # break the ctx <-> checkpointer cycle
        pairs = [(o, g) for o, g in zip(_as_tuple(outputs), grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(a.grad if torch.is_tensor(a) else None for a in inputs)


class CheckpointWithoutOutput:
    """One recompute region whose output storage is freed after its consumer ran.

    Create one object per call (micro-batches in flight each need their own).
    """

    def __init__(self):
        self.run_function = None
        self.ctx = None
        self.outputs = None
        self.recomputed = None
        self.rng_states = None
        self.tracker_states = None

    def checkpoint(self, run_function, *args):
        """Run ``run_function(*args)`` (tensors or other values) keeping only the tensor
        arguments for backward; returns its output(s), which take part in autograd."""
        self.run_function = run_function
        self.rng_states = get_device_rng_states()
        self.tracker_states = get_rng_tracker().get_states()
        outputs = _CheckpointWithoutOutputFunction.apply(self, *args)
        self.outputs = outputs
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: Optional[torch.Tensor]) -> None:
        """Free the outputs' storage and recompute it when the gradient of ``hook_tensor`` (a
        tensor computed from the consumer of the outputs, e.g. the consumer's output) arrives.

        Call it only after every consumer that saves the outputs has run forward. Without a
        gradient path (``hook_tensor`` None or not requiring grad) the storage is just freed.
        """
        self.output_nbytes = [o.untyped_storage().nbytes() for o in _as_tuple(self.outputs)]
        for o in _as_tuple(self.outputs):
            o.untyped_storage().resize_(0)
        if hook_tensor is not None and hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute_hook)

    def _recompute_hook(self, grad):
        self.recompute()
        for out, nbytes, new in zip(_as_tuple(self.outputs), self.output_nbytes,
                                    _as_tuple(self.recomputed[1])):
            out.untyped_storage().resize_(nbytes)
            # Write through a fresh alias: an in-place op on `out` would bump the version counter
            # that the consumer's saved tensor checks.
            alias = torch.empty(0, dtype=out.dtype, device=out.device)
            alias.set_(out.untyped_storage(), out.storage_offset(), out.size(), out.stride())
            with torch.no_grad():
                alias.copy_(new)
        return grad

    def recompute(self) -> None:
        """Re-run the function with autograd under the forward's random-number states."""
        saved = iter(self.ctx.saved_tensors)
        args = [self.non_tensor_args[i] if i in self.non_tensor_args else next(saved)
                for i in range(self.num_args)]
        inputs = [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a
                  for a in args]
        bwd_rng, bwd_tracker = get_device_rng_states(), get_rng_tracker().get_states()
        set_device_rng_states(self.rng_states)
        get_rng_tracker().set_states(self.tracker_states)
        try:
            with torch.enable_grad():
                outputs = self.run_function(*inputs)
        finally:
            set_device_rng_states(bwd_rng)
            get_rng_tracker().set_states(bwd_tracker)
        self.recomputed = (inputs, outputs)
