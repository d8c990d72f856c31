"""Activation recompute policy of the LLaMA layers (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 5; Megatron-LM's ``--recompute-*`` flags).

- ``full`` granularity: whole layers run without keeping activations; only each checkpointed
  group's input ``[s, b, h]`` (``[s/T, b, h]`` with sequence parallelism) is kept and the group
  is re-run in backward (Megatron's ``TransformerBlock._checkpointed_forward``):
  ``uniform`` checkpoints consecutive groups of ``recompute_num_layers`` layers, ``block`` the
  first ``recompute_num_layers`` layers of the stage (model chunk) one by one.
- ``selective`` granularity: inside each layer, the cheap functions named by
  ``recompute_modules`` are recomputed and neither their internals nor their outputs are kept
  (:class:`megatron.core.tensor_parallel.checkpoint_without_output.CheckpointWithoutOutput`):

  ============  ===============================================================================
  core_attn     rotary embedding + scaled_dot_product_attention (q, k, v after RoPE, the
                attention output and its softmax statistics)
  act           the SwiGLU activation ``silu(gate) * up`` (its two ``[s, b, f/T]`` tensors)
  layernorm     both RMSNorms of the layer (their ``[s, b, h]`` outputs, which the following
                linear layers would otherwise keep)
  mlp           the whole MLP block (re-runs its GEMMs; Megatron-Core's ``mlp``)
  moe_act       the routed experts' SwiGLU activation (MoE layers; ``[rows, f]``)
  moe           the whole MoE layer (router, dispatch, experts, combine; its input kept)
  shared_experts  the MoE layer's shared expert (its input kept)
  ============  ===============================================================================

  The default is ``core_attn act layernorm``: recompute without GEMMs. Megatron-Core's default is
  ``core_attn`` alone, which with flash-style attention (SDPA) keeps almost as much as no
  recompute, since the ``s x s`` scores are not stored anyway.

Every recompute replays the forward's random-number states, so dropout masks are identical.
"""

from __future__ import annotations

from typing import FrozenSet, Optional, Sequence

import torch

from megatron.core.tensor_parallel.random import checkpoint

RECOMPUTE_MODULES = ("core_attn", "act", "layernorm", "mlp", "moe_act", "moe", "shared_experts")
DEFAULT_RECOMPUTE_MODULES = ("core_attn", "act", "layernorm")


def check_recompute_config(granularity: Optional[str], method: Optional[str],
                           num_layers: Optional[int], modules: Optional[Sequence[str]],
                           layers_per_chunk: Optional[int] = None) -> None:
    """Check the ``--recompute-*`` combination.

    Args:
        granularity / method / num_layers / modules: the flags' values.
        layers_per_chunk: layers of one pipeline stage (model chunk), the upper bound of
            ``--recompute-num-layers``; None skips that bound.

    Raises:
        ValueError: naming the flag and the fix.
    """
    if granularity not in (None, "full", "selective"):
        raise ValueError(f"--recompute-granularity ({granularity}) must be full or selective")
    if granularity == "full":
        if method not in ("uniform", "block"):
            raise ValueError("--recompute-granularity full needs --recompute-method uniform or "
                             f"block (got {method})")
        if num_layers is None or num_layers < 1:
            raise ValueError(f"--recompute-granularity full needs --recompute-num-layers >= 1 "
                             f"(got {num_layers})")
        if layers_per_chunk is not None and num_layers > layers_per_chunk:
            raise ValueError(f"--recompute-num-layers ({num_layers}) must be <= the layers of one "
                             f"pipeline stage / model chunk ({layers_per_chunk})")
    elif method is not None or num_layers is not None:
        raise ValueError(f"--recompute-method ({method}) and --recompute-num-layers ({num_layers})"
                         " apply to --recompute-granularity full only: add it or drop them")
    if modules is not None:
        unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
        if unknown:
            raise ValueError(f"--recompute-modules {unknown} unknown: choose from "
                             f"{' '.join(RECOMPUTE_MODULES)}")
        if granularity != "selective":
            raise ValueError("--recompute-modules applies to selective recompute only: add "
                             "--recompute-activations (or --recompute-granularity selective)")


def selective_modules(config) -> FrozenSet[str]:
    """The modules a layer of ``config`` recomputes selectively (empty unless selective)."""
    if config.recompute_granularity != "selective":
        return frozenset()
    return frozenset(config.recompute_modules or DEFAULT_RECOMPUTE_MODULES)


def recompute_active(module: torch.nn.Module) -> bool:
    """Recompute only matters when a backward will follow: training with autograd on."""
    return module.training and torch.is_grad_enabled()


def _layers_function(layers, attention_mask):
    def run(hidden, *tables):  # (cos, sin) or (cos, sin, query_scale): the model's rotary
        for layer in layers:
            hidden = layer(hidden, tables, attention_mask)
        return hidden
    return run


def forward_layers(layers: Sequence[torch.nn.Module], hidden: torch.Tensor, rotary,
                   attention_mask, inference_params, config, *,
                   tp_group) -> torch.Tensor:
    """Run a stage's transformer layers, with full recompute where ``config`` asks for it.

    Args:
        layers: the stage's (model chunk's) layers, in order.
        hidden: ``[s, b, h]`` (``[s/T, b, h]`` with sequence parallelism).
        rotary: ``(cos, sin)`` of :class:`megatron.model.rotary.RotaryEmbedding`, with the
            NoPE layers' query scale ``[s, b, 1, 1]`` third under ``--attn-temperature-tuning``.
        attention_mask: None (causal) or an
            :class:`~megatron.model.attention_mask.AttentionMask`.
        inference_params: KV cache of generation (no recompute then), or None.
        config: the :class:`megatron.config.ModelConfig`.
        tp_group: the tensor-parallel group (of the recompute's RNG bookkeeping; None: a world
            of one).

    Returns:
        The last layer's output, shaped as ``hidden``.
    """
    full = (config.recompute_granularity == "full" and inference_params is None and len(layers) > 0
            and recompute_active(layers[0]))
    if not full:
        for layer in layers:
            hidden = layer(hidden, rotary, attention_mask, inference_params)
        return hidden
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        for start in range(0, len(layers), n):
            run = _layers_function(layers[start:start + n], attention_mask)
            hidden = checkpoint(run, False, hidden, *rotary, tp_group=tp_group)
        return hidden
    for i, layer in enumerate(layers):  # block
        if i < n:
            hidden = checkpoint(_layers_function([layer], attention_mask), False, hidden,
                                *rotary, tp_group=tp_group)
        else:
            hidden = layer(hidden, rotary, attention_mask)
    return hidden
