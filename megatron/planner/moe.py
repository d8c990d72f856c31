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


def dispatch_rows(tokens: int, topk: int, num_experts: int, *, token_set: int,
                  capacity_factor: Optional[float] = None, pad_to_capacity: bool = False,
                  etp: int = 1) -> tuple:
    """``(kept, rows)`` of one MoE layer's alltoall dispatch on one rank for one micro-batch,
    with the uniform routing the planner assumes (every expert gets ``N k / E`` choices of the
    micro-batch's N = ``token_set`` tokens, so a capacity factor >= 1 drops nothing): ``kept``
    the rank's choices sent (its T tokens x k, gathered over expert-TP: ``T etp k``), ``rows``
    the rows it sends and receives (``kept``; padded to capacity, ``E C`` with
    ``C = ceil(N k / E x factor) x etp`` rows per expert, zeros after the real ones)."""
    kept = tokens * etp * topk
    if not pad_to_capacity:
        return kept, kept
    capacity = math.ceil(token_set * topk / num_experts * capacity_factor) * etp
    return kept, num_experts * capacity


def dispatch_saved_bytes(tokens: int, topk: int, hidden_size: int, dtype_bytes: int,
                         num_experts: int, *, token_set: int, ffn_hidden_size: int,
                         capacity_factor: Optional[float] = None, pad_to_capacity: bool = False,
                         etp: int = 1) -> int:
    """Bytes the dispatch and combine of one MoE layer keep for backward, one micro-batch on one
    rank (the alltoall dispatcher, :mod:`megatron.core.transformer.moe.token_dispatcher`), with
    ``kept, rows`` of :func:`dispatch_rows`, h the hidden size and e the element size:

    * the permuted tokens the experts read, ``e rows h`` (their first GEMM's input), and the
      experts' output rows, ``e rows h`` (the combine's ``index_copy`` keeps its source);
    * the rows returned by the combine in fp32, ``4 kept h``, and the per-choice outputs the
      probabilities weight, ``4 T k h``, with the probabilities ``4 T k``;
    * the int64 indices: the choices' token ids and choice ids (``8 kept`` each) and the
      regrouping permutation (``8 rows``);
    * with ``--moe-pad-expert-input-to-capacity`` the real rows copied into the padded buffer
      (``e kept h``) and their slots (``8 kept``), and the experts' SwiGLU on the padding rows,
      ``3 e (rows - kept) f / etp`` (f = ``ffn_hidden_size``, the expert width).

    The experts' SwiGLU on the real rows (``3 e T k f``) is the activation model's (a dense
    layer of the active width); the router's ``[T, E]`` scores and ``[T, k]`` choices and the
    grouped GEMM's ``[E_local]`` int32 offsets are not counted. Checked
    against the bytes autograd keeps (``saved_tensors_hooks``) in
    tests/unit/planner/test_planner_moe.py."""
    kept, rows = dispatch_rows(tokens, topk, num_experts, token_set=token_set,
                               capacity_factor=capacity_factor,
                               pad_to_capacity=pad_to_capacity, etp=etp)
    h, e = hidden_size, dtype_bytes
    out = 2 * e * rows * h + 4 * kept * h + 4 * tokens * topk * h + 4 * tokens * topk
    out += 8 * (2 * kept + rows)
    if pad_to_capacity:
        out += e * kept * h + 8 * kept + 3 * e * (rows - kept) * (ffn_hidden_size // etp)
    return out


def dispatch_buffer_bytes(tokens: int, topk: int, hidden_size: int, dtype_bytes: int,
                          num_experts: int, *, token_set: int, ep: int,
                          capacity_factor: Optional[float] = None,
                          pad_to_capacity: bool = False, etp: int = 1) -> int:
    """The all-to-all's own buffers at their peak: one exchange's send and receive buffers,
    ``2 e rows h`` (the dispatch's permuted tokens and the rows received, the combine's and the
    two backward exchanges' gradients alike; padding included in ``rows``); none at EP = 1.
    They live only during the exchange: the planner adds them once per rank, on top of what is
    kept."""
    if ep == 1:
        return 0
    _, rows = dispatch_rows(tokens, topk, num_experts, token_set=token_set,
                            capacity_factor=capacity_factor, pad_to_capacity=pad_to_capacity,
                            etp=etp)
    return 2 * dtype_bytes * rows * hidden_size
