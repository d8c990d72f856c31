"""Pre-norm LLaMA transformer layer (Megatron-LM's ``ParallelTransformerLayer``).

Shapes: s = sequence, b = micro-batch, h = hidden.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model.attention import SelfAttention
from megatron.model.mlp import SwiGLUMLP
from megatron.model.rms_norm import RMSNorm


class TransformerLayer(torch.nn.Module):
    """``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``.

    Hidden dropout runs on the default generator: its input is replicated over the
    tensor-parallel group, so every rank must draw the same mask.

    Args:
        config: the model configuration.
        layer_number: global 1-based layer number (kept as ``self.layer_number``; seeds init).
        device: device of the parameters.
    """

    def __init__(self, config: ModelConfig, layer_number: int, device=None):
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        norm = dict(eps=config.norm_epsilon, sequence_parallel=config.sequence_parallel,
                    params_dtype=config.params_dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attention = SelfAttention(config, layer_number, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = SwiGLUMLP(config, layer_number, device=device)

    def forward(self, hidden: torch.Tensor, rotary: Tuple[torch.Tensor, torch.Tensor],
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``; ``rotary`` and ``attention_mask`` as in
        :meth:`SelfAttention.forward`."""
        attn = self.self_attention(self.input_layernorm(hidden), rotary, attention_mask)
        hidden = hidden + F.dropout(attn, self.hidden_dropout, self.training)
        mlp = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + F.dropout(mlp, self.hidden_dropout, self.training)
