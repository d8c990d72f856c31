"""Pre-norm LLaMA transformer layer (Megatron-LM's ``ParallelTransformerLayer``).

Shapes: s = sequence, b = micro-batch, h = hidden.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.model.attention import SelfAttention
from megatron.model.mlp import SwiGLUMLP
from megatron.model.rms_norm import RMSNorm


def hidden_dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout of hidden states ``[s, b, h]``: on the default generator (equal on every
    tensor-parallel rank, whose copies are replicated), or, with sequence parallelism, under the
    tracker's fork (each rank holds a different sequence chunk ``[s/T, b, h]``)."""
    if not (training and p > 0.0):
        return x
    if sequence_parallel:
        with get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


class TransformerLayer(torch.nn.Module):
    """``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``.

    Hidden dropout: see :func:`hidden_dropout`.

    Args:
        config: the model configuration.
        layer_number: global 1-based layer number (kept as ``self.layer_number``; seeds init).
        device: device of the parameters.
    """

    def __init__(self, config: ModelConfig, layer_number: int, device=None):
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
        norm = dict(eps=config.norm_epsilon, sequence_parallel=self.sequence_parallel,
                    params_dtype=config.params_dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attention = SelfAttention(config, layer_number, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = SwiGLUMLP(config, layer_number, device=device)

    def forward(self, hidden: torch.Tensor, rotary: Tuple[torch.Tensor, torch.Tensor],
                attention_mask: Optional[torch.Tensor] = None, inference_params=None) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``; ``rotary``, ``attention_mask`` and ``inference_params``
        (KV cache, generation only) as in :meth:`SelfAttention.forward`."""
        attn = self.self_attention(self.input_layernorm(hidden), rotary, attention_mask,
                                   inference_params)
        hidden = hidden + F.dropout(attn, self.hidden_dropout, self.training)
        mlp = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + F.dropout(mlp, self.hidden_dropout, self.training)
