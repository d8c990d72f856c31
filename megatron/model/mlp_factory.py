"""Which MLP a transformer layer holds: a registry of MLP builders keyed by the config and the
layer number (the seam a mixture-of-experts layer plugs into, as Megatron-Core's layer specs).

The contract of an MLP block, whatever builds it:

- ``builder(config, layer_number, *, pg_collection, device) -> torch.nn.Module``;
  ``layer_number`` is global and 1-based (it seeds the initialisation), ``pg_collection`` the
  run's :class:`~megatron.core.process_groups.ProcessGroupCollection` (a MoE layer takes its
  expert groups from it), ``device`` that of the parameters.
- ``forward(hidden [s, b, h]) -> [s, b, h]`` (``[s/T, b, h]`` both ways under sequence
  parallelism), the output reduced over the tensor-parallel group as a row-parallel linear's.
- An auxiliary loss (a MoE router's load-balancing loss) is returned as
  ``(output, aux_loss)`` with ``aux_loss`` a scalar tensor already scaled by its coefficient;
  :class:`~megatron.model.transformer.TransformerLayer` passes ``output`` on through
  :func:`attach_aux_loss`, so the aux loss's gradient joins backward with weight 1 without
  changing the language-model loss the schedule sees (Megatron-Core's ``MoEAuxLossAutoScaler``),
  and records its value in :data:`AUX_LOSSES` for logging.

Which builder a layer gets: :func:`mlp_kind`: ``"moe"`` (a
:class:`~megatron.core.transformer.moe.MoELayer`, built with the run's MoE section) on the layers
Megatron-Core's ``--moe-layer-freq`` names, else ``"dense"`` (the SwiGLU MLP).
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from megatron.config import ModelConfig
from megatron.core.transformer.moe import MoELayer, is_moe_layer, moe_token_group

MLPBuilder = Callable[..., torch.nn.Module]

_BUILDERS: Dict[str, MLPBuilder] = {}

# Detached ``[sum, count]`` of the aux losses by (kind, layer number) since the last
# ``AUX_LOSSES.clear()`` (the training logger's, once per logging interval).
AUX_LOSSES: Dict[tuple, List] = {}


def register_mlp(kind: str, builder: MLPBuilder) -> None:
    """Make ``builder`` the MLP of layers of ``kind``.

    Raises:
        ValueError: ``kind`` already registered (two plug-ins claiming one name).
    """
    if kind in _BUILDERS:
        raise ValueError(f"an MLP builder for {kind!r} is already registered")
    _BUILDERS[kind] = builder


def mlp_kind(config: ModelConfig, layer_number: int, moe_config=None) -> str:
    """The MLP kind of global 1-based layer ``layer_number``: ``"moe"`` where ``moe_config``
    (the run's MoE section, None for a dense model) names the layer, else ``"dense"``."""
    del config
    if moe_config is not None and is_moe_layer(moe_config, layer_number):
        return "moe"
    return "dense"


def build_mlp(config: ModelConfig, layer_number: int, *, pg_collection, device=None,
              kind: str | None = None, moe_config=None) -> torch.nn.Module:
    """The MLP block of layer ``layer_number`` (``kind`` overrides :func:`mlp_kind`); the
    ``"moe"`` builder also gets ``moe_config``.

    Raises:
        ValueError: no builder registered for the kind.
    """
    kind = mlp_kind(config, layer_number, moe_config) if kind is None else kind
    if kind not in _BUILDERS:
        raise ValueError(f"no MLP builder registered for {kind!r} (layer {layer_number}); "
                         f"known: {', '.join(sorted(_BUILDERS))}")
    extra = {"moe_config": moe_config} if kind == "moe" else {}
    return _BUILDERS[kind](config, layer_number, pg_collection=pg_collection, device=device,
                           **extra)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output``; in backward, ``aux_loss`` gets gradient 1 (it is a term of the
    loss that is not part of the value the schedule reduces)."""

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, key: tuple) -> torch.Tensor:
    """``output`` unchanged, with ``aux_loss`` (a scalar) joined to its backward; the detached
    value is added to ``AUX_LOSSES[key]`` (``[sum, count]``)."""
    total = AUX_LOSSES.setdefault(key, [0.0, 0])
    total[0] = total[0] + aux_loss.detach()
    total[1] += 1
    return _AttachAuxLoss.apply(output, aux_loss)


def _dense(config, layer_number, *, pg_collection, device=None):
    from megatron.model.mlp import SwiGLUMLP
    return SwiGLUMLP(config, layer_number, pg_collection=pg_collection, device=device)


def _moe(config, layer_number, *, pg_collection, device=None, moe_config):
    from megatron.model.recompute import selective_modules
    # It records its router losses itself (MoEAuxLossAutoScaler): the plain [s, b, h] output.
    ep, etp, dp = pg_collection.ep, pg_collection.expt_tp, pg_collection.dp
    sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
    return MoELayer(moe_config, hidden_size=config.hidden_size, seed=config.seed,
                    layer_number=layer_number, init_method_std=config.init_method_std,
                    num_layers=config.num_layers, params_dtype=config.params_dtype,
                    device=device, ep_group=ep.group if ep.size > 1 else None,
                    expert_tp_group=etp.group if etp.size > 1 else None,
                    dp_group=dp.group if dp.size > 1 else None,
                    token_group=moe_token_group(pg_collection, sequence_parallel),
                    recompute_modules=selective_modules(config))


register_mlp("dense", _dense)
register_mlp("moe", _moe)
