"""The SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up``,
shared by the dense MLP (:mod:`megatron.model.mlp`) and the experts
(:mod:`megatron.core.transformer.moe`); Megatron-Core keeps it in ``core/fusions``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up`` for ``gate_up = [gate, up]`` (last dim), keeping only ``gate_up``.

    Autograd of the composite keeps ``silu(gate)`` too and assembles the input gradient from two
    halves with a concatenation; here ``silu(gate)`` is recomputed in backward and both halves
    are written into one gradient tensor (``d up = dy silu(gate)``, ``d gate = silu'(gate) dy up``).
    """

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad_output):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad = torch.empty_like(gate_up)
        grad_gate, grad_up = grad.chunk(2, dim=-1)
        torch.mul(grad_output, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad_output * up, gate, grad_input=grad_gate)
        return grad


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2f] = [gate, up]``: ``[..., f]``, same dtype.

    Under ``torch.compile`` the plain expression is traced (the compiler fuses it by itself).
    """
    if torch.compiler.is_compiling():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLUFunction.apply(gate_up)
