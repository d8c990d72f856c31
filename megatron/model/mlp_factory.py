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

Which builder a layer gets: :func:`mlp_kind` (``"dense"``, the SwiGLU MLP, for every layer today;
a MoE layer pattern such as Megatron-Core's ``--moe-layer-freq`` is a rule added there).
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from megatron.config import ModelConfig

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


def mlp_kind(config: ModelConfig, layer_number: int) -> str:
    """The MLP kind of global 1-based layer ``layer_number``: ``"dense"`` for every layer."""
    del config, layer_number
    return "dense"


def build_mlp(config: ModelConfig, layer_number: int, *, pg_collection, device=None,
              kind: str | None = None) -> torch.nn.Module:
    """The MLP block of layer ``layer_number`` (``kind`` overrides :func:`mlp_kind`).

    Raises:
        ValueError: no builder registered for the kind.
    """
    kind = mlp_kind(config, layer_number) if kind is None else kind
    if kind not in _BUILDERS:
        raise ValueError(f"no MLP builder registered for {kind!r} (layer {layer_number}); "
                         f"known: {', '.join(sorted(_BUILDERS))}")
    return _BUILDERS[kind](config, layer_number, pg_collection=pg_collection, device=device)


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


register_mlp("dense", _dense)
