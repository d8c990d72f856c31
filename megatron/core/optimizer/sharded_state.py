"""Optimizer state in global coordinates, for distributed checkpoints (``--ckpt-format torch_dist``).

Every optimizer gives its tensors as boxes of global tensors named after the parameter's global
key (:mod:`megatron.model.sharded_state`), Megatron-Core's names::

    optimizer.state.exp_avg.<key>      Adam's first moment, fp32, the parameter's global shape
    optimizer.state.exp_avg_sq.<key>   Adam's second moment
    optimizer.state.fp32_param.<key>   the fp32 main parameter (bf16/fp16 models only; an fp32
                                       model's main parameters are its weights, ``model.<key>``)

and the rest as plain data (``param_groups`` hyperparameters, Adam's ``step``, the fp16 loss
scaler's state). A plain optimizer holds each tensor whole on every data-parallel rank (its boxes
are replicas over DP: the caller chooses the writers); the distributed optimizer holds, per bucket
shard, pieces ``[start, end)`` of flattened parameters, each saved as the few boxes it covers
(:meth:`~megatron.core.dist_checkpointing.mapping.ParamSharding.flat_boxes`). Both read any
checkpoint: DCP cuts the saved boxes into the ones a rank holds, so a plain optimizer's checkpoint
loads into the distributed optimizer at any DP size, and the other way round.

A new parameter layout (ZeRO-3: parameters sharded over DP like the distributed optimizer's
state) implements :class:`ShardedState` the same way: the boxes of what each rank holds, in these
global keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch

from megatron.core.dist_checkpointing.mapping import ParamSharding, ShardedTensor

EXP_AVG = "optimizer.state.exp_avg."
EXP_AVG_SQ = "optimizer.state.exp_avg_sq."
FP32_PARAM = "optimizer.state.fp32_param."
MOMENTS = (("exp_avg", EXP_AVG), ("exp_avg_sq", EXP_AVG_SQ))


@dataclass
class ShardedState:
    """What an optimizer saves, or wants to load.

    Attributes:
        replicated: boxes held identically by every data-parallel rank (the caller picks one
            writer per box).
        owned: boxes of this data-parallel rank alone (distributed-optimizer shards).
        common: plain data, equal on every rank (saving).
        finish: after a load has filled the boxes, installs them as optimizer state, given the
            checkpoint's ``common`` (loading).
    """

    replicated: List[ShardedTensor] = field(default_factory=list)
    owned: List[ShardedTensor] = field(default_factory=list)
    common: dict = field(default_factory=dict)
    finish: Callable[[dict], None] = lambda common: None


def common_state(optimizer) -> dict:
    """Hyperparameters of the parameter groups, Adam's step, the loss scaler."""
    step = 0
    for state in optimizer.optimizer.state.values():
        if "step" in state:
            step = max(step, int(state["step"]))
    return {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in optimizer.optimizer.param_groups],
            "step": step,
            "grad_scaler": (optimizer.grad_scaler.state_dict()
                            if optimizer.grad_scaler is not None else None)}


def _load_common(optimizer, common: dict, where: str) -> int:
    groups = optimizer.optimizer.param_groups
    if len(common["param_groups"]) != len(groups):
        raise ValueError(f"{where}: {len(common['param_groups'])} optimizer parameter groups "
                         f"saved, the model has {len(groups)}; load with --no-load-optim")
    for group, saved in zip(groups, common["param_groups"]):
        group.update(saved)
    if optimizer.grad_scaler is not None and common.get("grad_scaler"):
        optimizer.grad_scaler.load_state_dict(common["grad_scaler"])
    return int(common["step"])


def _adam_state(optimizer, main: torch.Tensor, step: int, moments: Dict[str, torch.Tensor]) -> dict:
    # torch's fused AdamW keeps the step on the parameter's device, the others on the CPU.
    device = main.device if optimizer.optimizer.defaults.get("fused", False) else "cpu"
    state = {"step": torch.tensor(float(step), dtype=torch.float32, device=device)}
    state.update({k: v.to(main.device) for k, v in moments.items()})
    return state


def _moment(state: dict, name: str, like: torch.Tensor) -> torch.Tensor:
    value = state.get(name)
    return value.detach() if value is not None else torch.zeros_like(like, dtype=torch.float32)


def _main_prefix(saved: set, sharding: ParamSharding) -> str:
    """Where a main parameter comes from: the saved fp32 main parameter, else the saved weights."""
    if all(FP32_PARAM + r.key in saved for r in sharding.regions):
        return FP32_PARAM
    return "model."


# Plain optimizers (FP32Optimizer, Float16OptimizerWithFloat16Params) -----------------------------

def plain_sharded_state(optimizer, shardings: Dict[torch.nn.Parameter, ParamSharding]) -> ShardedState:
    """The state of a plain optimizer to save (boxes are views; see the module docstring)."""
    out = ShardedState(common=common_state(optimizer))
    for p, main in optimizer.model_main_pairs():
        sharding = shardings[p]
        state = optimizer.optimizer.state.get(main, {})
        for name, prefix in MOMENTS:
            out.replicated += sharding.boxes(_moment(state, name, main), prefix)
        if main is not p:
            out.replicated += sharding.boxes(main.detach(), FP32_PARAM)
    return out


def plain_load_targets(optimizer, shardings: Dict[torch.nn.Parameter, ParamSharding],
                       saved: set) -> ShardedState:
    """Boxes to fill from a checkpoint whose keys are ``saved``, and the step that installs them."""
    out = ShardedState()
    moments = []
    for p, main in optimizer.model_main_pairs():
        sharding = shardings[p]
        values = {name: torch.zeros(main.shape, dtype=torch.float32) for name, _ in MOMENTS}
        for name, prefix in MOMENTS:
            out.replicated += sharding.boxes(values[name], prefix)
        if main is not p:  # read straight into the main parameter
            out.replicated += sharding.boxes(main.data, _main_prefix(saved, sharding))
        moments.append((main, values))

    def finish(common: dict) -> None:
        step = _load_common(optimizer, common, "optimizer checkpoint")
        for main, values in moments:
            optimizer.optimizer.state[main] = _adam_state(optimizer, main, step, values)

    out.finish = finish
    return out


# The distributed optimizer -----------------------------------------------------------------------

def _pieces(optimizer, shardings):
    """``(run, piece, sharding)`` for every piece of every run (names resolved to parameters)."""
    from megatron.core.optimizer.distrib_optimizer_checkpoint import param_names

    by_name = {name: p for p, name in param_names(optimizer.model_chunks).items()}
    for run in optimizer.runs:
        for piece in run.pieces:
            yield run, piece, shardings[by_name[piece.name]]


def _mixed_precision(optimizer) -> bool:
    return any(main is not shard for shard, main in optimizer.shards)


def distributed_sharded_state(optimizer, shardings) -> ShardedState:
    """The distributed optimizer's state to save: its pieces as boxes (views of its shards)."""
    optimizer.finish_param_sync()
    out = ShardedState(common=common_state(optimizer))
    mixed = _mixed_precision(optimizer)
    for run, piece, sharding in _pieces(optimizer, shardings):
        state = optimizer.optimizer.state.get(run.main, {})
        at, n = piece.offset, piece.end - piece.start
        for name, prefix in MOMENTS:
            flat = _moment(state, name, run.main)[at:at + n]
            out.owned += sharding.flat_boxes(piece.start, piece.end, flat, prefix)
        if mixed:
            out.owned += sharding.flat_boxes(piece.start, piece.end,
                                             run.main.detach()[at:at + n], FP32_PARAM)
    return out


def distributed_load_targets(optimizer, shardings, saved: set) -> ShardedState:
    """Boxes to fill (views of fresh moment buffers and of the fp32 main shards)."""
    out = ShardedState()
    mixed = _mixed_precision(optimizer)
    buffers = {id(run.main): (run.main, {name: torch.zeros(run.main.numel(), dtype=torch.float32)
                                         for name, _ in MOMENTS}) for run in optimizer.runs}
    for run, piece, sharding in _pieces(optimizer, shardings):
        at, n = piece.offset, piece.end - piece.start
        values = buffers[id(run.main)][1]
        for name, prefix in MOMENTS:
            out.owned += sharding.flat_boxes(piece.start, piece.end, values[name][at:at + n],
                                             prefix)
        if mixed:
            out.owned += sharding.flat_boxes(piece.start, piece.end, run.main.data[at:at + n],
                                             _main_prefix(saved, sharding))

    def finish(common: dict) -> None:
        step = _load_common(optimizer, common, "optimizer checkpoint")
        for main, values in buffers.values():
            optimizer.optimizer.state[main] = _adam_state(optimizer, main, step, values)

    out.finish = finish
    return out


# A chained optimizer (dense and expert parts) ----------------------------------------------------

def chain_states(states: List[ShardedState]) -> ShardedState:
    """The parts' states as one: boxes together (their keys are disjoint: each parameter is in
    one part), ``common`` ``{"chained_optimizers": [part common, ...]}``, and a ``finish`` that
    hands each part its own common.

    The finish raises ValueError for a checkpoint of another number of parts."""
    out = ShardedState(common={"chained_optimizers": [s.common for s in states]})
    for s in states:
        out.replicated += s.replicated
        out.owned += s.owned

    def finish(common: dict) -> None:
        saved = common.get("chained_optimizers")
        if saved is None or len(saved) != len(states):
            found = "one optimizer" if saved is None else f"{len(saved)} optimizer parts"
            raise ValueError(f"optimizer checkpoint: it holds {found}, this model has "
                             f"{len(states)} (dense and expert parameters); load with "
                             "--no-load-optim or use the same model configuration")
        for s, part_common in zip(states, saved):
            s.finish(part_common)

    out.finish = finish
    return out
