"""Mixture-of-experts terms of the planner: expert parameters per rank, their gradients and
optimizer state over expert-DP, and the all-to-all traffic of the token dispatcher.

An MoE layer (:class:`megatron.core.transformer.moe.MoELayer`) replaces the dense SwiGLU by

* the router ``weight [E, h]`` and the shared expert (``linear_fc1 [2 f_s, h]``,
  ``linear_fc2 [h, f_s]``, with ``--moe-shared-expert-gate`` ``gate_weight [1, h]``): *dense*
  parameters, replicated over TP (not split) and reduced over DP x CP like the rest;
* the routed experts ``weight1 [E/EP, 2f, h]`` and ``weight2 [E/EP, h, f]`` (f =
  ``--moe-ffn-hidden-size``), split over expert-TP (``2f / expert-TP`` and ``f / expert-TP``
  rows): *expert* parameters, with gradient buffers of their own reduced over expert-DP, the
  ranks holding the same experts: ``expert-DP = TP x CP x DP / (EP x expert-TP)``
  (:mod:`megatron.core.process_groups`), and with the distributed optimizer sharded over it.

Units: elements for ``*_numels``, bytes otherwise. ``tests/unit/planner/test_planner_moe.py``
checks the counts against a built layer's storages at EP=1 and EP=2 and the all-to-all bytes
against the alltoall dispatcher's counted splits.
"""

from __future__ import annotations

import math
from typing import List, Optional

from megatron.config import ModelConfig
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.model.flops import moe_layers
from megatron.planner.inventory import stage_inventory


def is_moe(moe: Optional[MoEConfig]) -> bool:
    """A mixture-of-experts model: ``moe`` given with ``num_experts``."""
    return moe is not None and bool(moe.num_experts)


def expert_data_parallel_size(tp: int, cp: int, dp: int, ep: int, etp: int) -> int:
    """Ranks holding the same experts of a stage: ``TP x CP x DP / (EP x expert-TP)``.

    Raises:
        ValueError: EP x expert-TP does not divide TP x CP x DP (naming the flags)."""
    stage = tp * cp * dp
    if stage % (ep * etp):
        raise ValueError(f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size "
                         f"({etp}) must divide TP x CP x DP ({stage})")
    return stage // (ep * etp)


def moe_expert_numels(config: ModelConfig, moe: MoEConfig, ep: int, etp: int = 1) -> List[int]:
    """Expert parameters of one MoE layer on one rank, read from the first MoE layer of the
    model built on the meta device at EP (``weight1 [E/EP, 2f, h]``, ``weight2 [E/EP, h, f]``),
    each divided by expert-TP (which splits every expert's ffn width f; the model does not build
    expert-TP shards itself).

    Raises:
        ValueError: E not divisible by EP, or f by expert-TP."""
    shapes = next(s for s in stage_inventory(config, 1, 1, 0, moe, ep).expert_shapes if s)
    f = shapes[-1][-1]  # weight2's columns: the expert's ffn width
    if f % etp:
        raise ValueError(f"--moe-ffn-hidden-size ({f}) must be divisible by "
                         f"--expert-tensor-parallel-size ({etp})")
    return [math.prod(shape) // etp for shape in shapes]


def stage_moe_layers(config: ModelConfig, moe: Optional[MoEConfig], pp: int, pp_rank: int) -> List[bool]:
    """Which layers of stage ``pp_rank`` (of ``pp`` equal stages) are MoE layers."""
    per = config.num_layers // pp
    return moe_layers(moe, config.num_layers)[pp_rank * per:(pp_rank + 1) * per]


def stage_expert_numels(config: ModelConfig, moe: Optional[MoEConfig], pp: int, pp_rank: int,
                        ep: int, etp: int = 1) -> List[int]:
    """Expert parameters of stage ``pp_rank`` on one rank, in registration order (empty for a
    dense model), read from the stage built on the meta device and divided by expert-TP as
    :func:`moe_expert_numels`."""
    if not is_moe(moe):
        return []
    moe_expert_numels(config, moe, ep, etp)  # E % EP and f % expert-TP
    return [n // etp for n in stage_inventory(config, 1, pp, pp_rank, moe, ep).expert]


def alltoall_bytes_per_iteration(tokens_per_rank: int, topk: int, hidden_size: int,
                                 dtype_bytes: int, ep: int, moe_layers_per_rank: int = 1) -> float:
    """Bytes one rank sends through the alltoall dispatcher per iteration (received: the same on
    average): ``4 x T x k x h x e x (EP - 1) / EP`` per MoE layer.

    Derivation: each of the rank's ``T`` tokens (its micro-batches' tokens over the iteration,
    ``s / CP x b x m``, with sequence parallelism ``/ TP``) is sent once per chosen expert
    (``k`` rows of ``h`` elements of ``e`` bytes); with uniform routing a fraction
    ``(EP - 1) / EP`` of the experts lives on other ranks (the rest stays local, no traffic).
    The forward sends the rows out (dispatch) and brings the expert outputs back (combine),
    the backward does the same for their gradients in reverse: 4 exchanges of ``T k h e`` bytes.
    Dropless; with ``--moe-expert-capacity-factor`` it is an upper bound. Full recompute adds
    one forward (2 more exchanges), not counted here.
    """
    return 4.0 * tokens_per_rank * topk * hidden_size * dtype_bytes * (ep - 1) / ep * moe_layers_per_rank
