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
from megatron.model.attention_mask import AttentionMask
from megatron.core.tensor_parallel.checkpoint_without_output import CheckpointWithoutOutput
from megatron.model.mlp_factory import attach_aux_loss, build_mlp, mlp_kind
from megatron.model.recompute import recompute_active, selective_modules
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

    Hidden dropout: see :func:`hidden_dropout`. With selective recompute of ``layernorm``
    (:mod:`megatron.model.recompute`) each norm's output is freed once the block that reads it
    has run, and recomputed when backward reaches that block.

    Args:
        config: the model configuration.
        layer_number: global 1-based layer number (kept as ``self.layer_number``; seeds init).
        pg_collection: the process groups of the attention and MLP blocks.
        device: device of the parameters.
        moe_config: the MoE section; the layers ``--moe-layer-freq`` names get a
            :class:`~megatron.core.transformer.moe.MoELayer` as their MLP, its experts spread
            over ``pg_collection.ep`` and its capacity and losses taken over the micro-batch's
            token set (:func:`~megatron.core.transformer.moe.moe_token_group`). None: a dense
            model.
    """

    def __init__(self, config: ModelConfig, layer_number: int, *, pg_collection, device=None,
                 moe_config=None):
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
        norm = dict(eps=config.norm_epsilon, sequence_parallel=self.sequence_parallel,
                    params_dtype=config.params_dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attention = SelfAttention(config, layer_number, pg_collection=pg_collection,
                                            device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        # The MLP of this layer's kind (megatron.model.mlp_factory: dense SwiGLU, a MoELayer on
        # the layers --moe-layer-freq names, or a plug-in).
        self.mlp_kind = mlp_kind(config, layer_number, moe_config)
        self.mlp = build_mlp(config, layer_number, pg_collection=pg_collection, device=device,
                             kind=self.mlp_kind, moe_config=moe_config)
        self.recompute_norms = "layernorm" in selective_modules(config)

    def _norm_then(self, norm, block, hidden, *args):
        """``block(norm(hidden), *args)``, keeping no copy of the norm's output if asked."""
        if not (self.recompute_norms and recompute_active(self)):
            return block(norm(hidden), *args)
        ckpt = CheckpointWithoutOutput()
        out = block(ckpt.checkpoint(norm, hidden), *args)
        if isinstance(out, tuple):
            # An aux loss is a second way back into the norm's output, which a hook on one
            # output would not guard: the output is kept (the checkpoint recomputes the graph).
            return out
        ckpt.discard_output_and_register_recompute(out)
        return out

    def forward(self, hidden: torch.Tensor, rotary: Tuple[torch.Tensor, torch.Tensor],
                attention_mask: Optional[AttentionMask] = None,
                inference_params=None) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``; ``rotary``, ``attention_mask`` and ``inference_params``
        (KV cache, generation only) as in :meth:`SelfAttention.forward`."""
        attn = self._norm_then(self.input_layernorm, self.self_attention, hidden, rotary,
                               attention_mask, inference_params)
        hidden = hidden + hidden_dropout(attn, self.hidden_dropout, self.training,
                                         self.sequence_parallel)
        mlp = self._norm_then(self.post_attention_layernorm, self.mlp, hidden)
        if isinstance(mlp, tuple):  # (output, auxiliary loss): the factory's contract
            mlp = attach_aux_loss(mlp[0], mlp[1], (self.mlp_kind, self.layer_number))
        return hidden + hidden_dropout(mlp, self.hidden_dropout, self.training,
                                       self.sequence_parallel)
