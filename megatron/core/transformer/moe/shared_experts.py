"""The shared expert (Megatron-Core's ``SharedExpertMLP``): a SwiGLU MLP every token goes through,
added to the routed experts' output, optionally gated by ``sigmoid(x w_gate)`` (Qwen2-MoE's
``shared_expert_gate``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.transformer.initialization import init_block, scaled_std
from megatron.core.transformer.swiglu import swiglu


class SharedExpertMLP(torch.nn.Module):
    """``linear_fc1 [2f_s, h]`` (``[gate; up]``), ``linear_fc2 [h, f_s]``, with the gate
    ``gate_weight [1, h]``; each drawn from ``(seed, layer, "mlp.shared_experts.<name>")``.

    Args:
        hidden_size: h. ffn_hidden_size: f_s (``--moe-shared-expert-intermediate-size``).
        gate: ``--moe-shared-expert-gate``.
        recompute: ``--recompute-modules shared_experts`` (Megatron-Core's name): in training
            only the input is kept and the whole block re-runs in backward.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, gate: bool, seed: int,
                 layer_number: int, init_method_std: float, num_layers: int,
                 params_dtype=torch.float32, device=None, recompute: bool = False):
        super().__init__()
        self.recompute = recompute
        shapes = {"linear_fc1": (2 * ffn_hidden_size, hidden_size),
                  "linear_fc2": (hidden_size, ffn_hidden_size)}
        if gate:
            shapes["gate_weight"] = (1, hidden_size)
        for name, shape in shapes.items():
            std = scaled_std(init_method_std, num_layers) if name == "linear_fc2" else init_method_std
            w = init_block(shape, std, seed, layer_number, f"mlp.shared_experts.{name}",
                           device=device)  # nothing drawn on the meta device
            setattr(self, name, torch.nn.Parameter(w.to(dtype=params_dtype, device=device)))
        if not gate:
            self.gate_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, h] -> [T, h]``."""
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, False, x, tp_group=None)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(swiglu(F.linear(x, self.linear_fc1)), self.linear_fc2)
        if self.gate_weight is not None:
            out = torch.sigmoid(F.linear(x, self.gate_weight)) * out
        return out
