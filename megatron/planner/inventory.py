"""The planner's parameter inventory, read from the model itself: one rank's pipeline stage of
:class:`~megatron.model.llama.LlamaModel` built on the meta device (no storage, nothing drawn)
with the *planned* groups of the layout (:class:`~megatron.core.process_groups.PlannedGroup`:
sizes and ranks, no communicator). A model change (a bias, q/k norms, another MLP) reaches the
planner's bytes without a planner edit: names, shapes, the expert mark
(:func:`~megatron.core.distributed.expert_params.is_expert_param`) and the ZeRO-3 units
(:func:`~megatron.core.distributed.param_units.unit_assignment`, the function DDP uses, with the
transformer layers as unit modules) all come from the built modules.

Units: elements. Builds are cached per ``(config, tp, pp, pp_rank, moe, ep)``: a ranking of
layouts asks for the same stage many times.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

import torch

from megatron.config import ModelConfig
from megatron.core.process_groups import ParallelGroup, PlannedGroup, ProcessGroupCollection
from megatron.core.transformer.moe.moe_config import MoEConfig


@dataclass(frozen=True)
class StageInventory:
    """One rank's parameters of one pipeline stage (one tensor-parallel and expert-parallel
    rank), in registration order.

    Attributes:
        names: every parameter's name, dense and expert, in registration order.
        dense: element counts of the dense parameters (reduced over DP x CP).
        expert: element counts of the expert parameters (reduced over expert-DP).
        is_expert: for each name, whether the parameter is an expert one (the two kinds'
            interleaving, which ZeRO-2's gradient timeline follows).
        expert_shapes: shapes of each transformer layer's expert parameters, one tuple per
            layer of the stage (empty for a dense layer).
        units: ZeRO-3's units of the dense parameters, root unit (embedding, final norm, output
            layer) first, then one per transformer layer: each unit a tuple of
            ``(elements, alone)``, ``alone`` for a parameter with a bucket of its own (the tied
            embedding copy at PP > 1, marked ``shared_embedding``).
    """

    names: Tuple[str, ...]
    dense: Tuple[int, ...]
    expert: Tuple[int, ...]
    is_expert: Tuple[bool, ...]
    expert_shapes: Tuple[Tuple[Tuple[int, ...], ...], ...]
    units: Tuple[Tuple[Tuple[int, bool], ...], ...]


def _planned(size: int, rank: int = 0) -> ParallelGroup:
    return ParallelGroup(PlannedGroup(size, rank) if size > 1 else None, tuple(range(size)), rank)


def planned_groups(tp: int, pp: int = 1, pp_rank: int = 0, ep: int = 1) -> ProcessGroupCollection:
    """The groups rank 0 of TP, rank 0 of EP and rank ``pp_rank`` of PP would hold, planned only
    (every other group of one): enough to build that rank's stage on the meta device."""
    one = ParallelGroup.of_one(None, 0)
    return ProcessGroupCollection(tp=_planned(tp), pp=_planned(pp, pp_rank), dp=one, cp=one,
                                  dp_cp=one, model=one, embedding=one, ep=_planned(ep))


def build_meta_stage(config: ModelConfig, tp: int, pp: int = 1, pp_rank: int = 0,
                     moe: Optional[MoEConfig] = None, ep: int = 1) -> torch.nn.Module:
    """Stage ``pp_rank`` of ``config`` (``pp`` equal stages) as one TP rank and one EP rank build
    it, on the meta device. ``config``'s own TP / CP sizes are replaced by ``tp`` and 1 (CP
    changes no parameter); an unset ``moe_ffn_hidden_size`` becomes ``ffn_hidden_size`` (as
    argument validation fills it).

    Raises:
        ValueError: as :class:`~megatron.model.llama.LlamaModel` and
            :class:`~megatron.core.transformer.moe.MoELayer` (sizes not divisible by TP or EP,
            layers by PP)."""
    from megatron.model import get_layer_numbers
    from megatron.model.llama import LlamaModel

    moe = moe if moe is not None and moe.num_experts else None
    # Parameters do not depend on SP; a MoE layer at TP > 1 is only built with it (as trained).
    config = config.replace(tensor_model_parallel_size=tp, context_parallel_size=1,
                            sequence_parallel=config.sequence_parallel or (moe is not None and tp > 1))
    if moe is not None and moe.moe_ffn_hidden_size is None:  # validation's default, as the run's
        moe = dataclasses.replace(moe, moe_ffn_hidden_size=config.ffn_hidden_size)
    return LlamaModel(config, pg_collection=planned_groups(tp, pp, pp_rank, ep),
                      pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                      layer_numbers=get_layer_numbers(config.num_layers, pp, pp_rank),
                      device=torch.device("meta"), moe_config=moe)


def _hashable(value):
    """``value`` with its dicts and lists made tuples (a config's ``rope_scaling`` is a dict)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__,
                tuple((f.name, _hashable(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _hashable(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


class _Key:
    """A cache key for a config: equal and hashed by :func:`_hashable`, holding the config."""

    def __init__(self, config):
        self.config, self._key = config, _hashable(config)

    def __eq__(self, other):
        return isinstance(other, _Key) and self._key == other._key

    def __hash__(self):
        return hash(self._key)


# The last keys made, by the identity of their (frozen) config: a ranking asks for the stages of
# one config object thousands of times, and making its key walks every field.
_KEYS: "OrderedDict[int, _Key]" = OrderedDict()


def _key(config) -> _Key:
    """``_Key(config)``, made once per config object (the key holds the object, so its id is not
    reused while it is remembered)."""
    key = _KEYS.get(id(config))
    if key is None or key.config is not config:
        key = _KEYS[id(config)] = _Key(config)
        if len(_KEYS) > 64:
            _KEYS.popitem(last=False)
    return key


def stage_inventory(config: ModelConfig, tp: int, pp: int = 1, pp_rank: int = 0,
                    moe: Optional[MoEConfig] = None, ep: int = 1) -> StageInventory:
    """The :class:`StageInventory` of :func:`build_meta_stage`'s model (same arguments and
    errors); cached, also for configs holding a dict (``rope_scaling``)."""
    return _stage_inventory(_key(config), tp, pp, pp_rank, _key(moe), ep)


@lru_cache(maxsize=256)
def _stage_inventory(config: _Key, tp: int, pp: int, pp_rank: int, moe: _Key,
                     ep: int) -> StageInventory:
    config, moe = config.config, moe.config
    from megatron.core.distributed.expert_params import is_expert_param
    from megatron.core.distributed.param_units import unit_assignment

    model = build_meta_stage(config, tp, pp, pp_rank, moe, ep)
    named = list(model.named_parameters())
    unit_of = unit_assignment(model, list(model.layers))
    dense = [(p, unit_of[p]) for _, p in named if not is_expert_param(p)]
    units = tuple(tuple((p.numel(), bool(vars(p).get("shared_embedding", False)))
                        for p, u in dense if u == i) for i in range(len(model.layers) + 1))
    return StageInventory(names=tuple(n for n, _ in named),
                          dense=tuple(p.numel() for p, _ in dense),
                          expert=tuple(p.numel() for _, p in named if is_expert_param(p)),
                          is_expert=tuple(bool(is_expert_param(p)) for _, p in named),
                          expert_shapes=tuple(tuple(tuple(p.shape) for p in layer.parameters()
                                                    if is_expert_param(p))
                                              for layer in model.layers),
                          units=units)
