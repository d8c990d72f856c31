"""Per-rank memory of a LLaMA training layout: parameters, gradients, optimizer state, activations.

Parameters, gradient buffers and optimizer state are counted exactly as this codebase allocates
them (``LlamaModel``'s parameters in registration order, read from the model built on the meta
device by :mod:`megatron.planner.inventory`, the DDP grad buffer's DP-padded buckets,
torch AdamW's state). Activations follow Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (section 4, equations 1-5), adapted to what our LLaMA
layer saves for backward: RMSNorm instead of LayerNorm (fp32 statistics), SwiGLU instead of GeLU,
grouped-query attention, SDPA/flash attention (no ``s x s`` scores or softmax stored, a
log-sum-exp per head and token instead), no dropout masks when dropout is 0. Recompute follows
:mod:`megatron.model.recompute` (selective with its default modules, full uniform / block).
tests/unit/planner/test_planner.py checks every activation count against the bytes autograd saves.
Context parallelism (CP ranks per sequence) divides every activation by CP: a rank runs its
``s / CP`` tokens through the same layers, and the split attention keeps what SDPA keeps for
them (tests/unit/model/test_recompute.py asserts exactly 1/CP); the buffers that live only during
one layer's attention are not counted (p2p: the next rank's key/value block and the fp32 output
accumulator; all_gather: the keys and values of the whole sequence, ``2 e b s g d / t``).
Gradients are reduced, and the distributed optimizer shards, over DP x CP ranks.

Units: bytes unless a name says elements. Shapes: s = sequence, b = micro-batch, h = hidden,
f = ffn hidden, n / g = query heads / key-value groups, d = per-head width, v = padded vocabulary,
t = tensor-parallel size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import FrozenSet, List, Optional, Sequence, Tuple

from megatron.config import ModelConfig
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.distributed.param_and_grad_buffer import default_bucket_size
from megatron.model.flops import active_ffn_hidden_sizes
from megatron.planner.inventory import stage_inventory
from megatron.planner.moe import (dispatch_buffer_bytes, dispatch_saved_bytes,
                                  expert_data_parallel_size, is_moe, stage_expert_numels,
                                  stage_moe_layers)

RECOMPUTE_CHOICES = ("none", "selective", "full")


def param_numels(config: ModelConfig, tp: int, pp: int = 1, pp_rank: int = 0,
                 moe: Optional[MoEConfig] = None) -> List[int]:
    """Element counts of one rank's dense parameters, in registration order, read from the stage
    built on the meta device (:func:`megatron.planner.inventory.stage_inventory`).

    Args:
        config: the whole model (its ``tensor_model_parallel_size`` is ignored; ``tp`` is used).
        tp / pp: tensor- and pipeline-parallel sizes; pp_rank: the pipeline stage.
        moe: the MoE section; its MoE layers' router and shared expert are dense parameters
            (counted here), their routed experts are not (expert parameters:
            :func:`megatron.planner.moe.stage_expert_numels`).

    Returns:
        One entry per dense parameter tensor of the stage on one tensor-parallel rank.

    Raises:
        ValueError: as :class:`~megatron.model.llama.LlamaModel` (a size not divisible by TP,
            layers by PP).
    """
    return list(stage_inventory(config, tp, pp, pp_rank, moe).dense)


def bucket_numels(numels: List[int], dp: int, bucket_size: Optional[int] = None,
                  alone: Sequence[int] = ()) -> List[int]:
    """Padded elements of each DDP bucket, in buffer order (the order their gradients become
    final in backward): parameters laid out in reverse registration order, a bucket closed at
    ``bucket_size`` elements (None: the DDP default,
    :func:`~megatron.core.distributed.param_and_grad_buffer.default_bucket_size`) and padded to
    a multiple of ``dp`` (``ParamAndGradBuffer``'s layout). ``alone``: indices into ``numels``
    of parameters with a bucket of their own (the tied copy of the embedding at PP > 1 under
    the distributed optimizer)."""
    if bucket_size is None:
        bucket_size = default_bucket_size(dp)
    return list(_bucket_numels(tuple(numels), dp, bucket_size, frozenset(alone)))


@lru_cache(maxsize=4096)  # a ranking asks for the same stage's buckets for many layouts
def _bucket_numels(numels: Tuple[int, ...], dp: int, bucket_size: int,
                   alone: FrozenSet[int]) -> Tuple[int, ...]:
    pad = lambda n: -(-n // dp) * dp  # noqa: E731
    out, cursor = [], 0
    for i in reversed(range(len(numels))):
        if i in alone and cursor:
            out.append(pad(cursor))
            cursor = 0
        cursor += numels[i]
        if i in alone or cursor >= bucket_size:
            out.append(pad(cursor))
            cursor = 0
    if cursor:
        out.append(pad(cursor))
    return tuple(out)


def grad_buffer_numel(numels: List[int], dp: int, bucket_size: Optional[int] = None) -> int:
    """Elements of the DDP gradient buffer: the sum of :func:`bucket_numels`."""
    return sum(bucket_numels(numels, dp, bucket_size))


def sharded_grad_window_numel(buckets: List[int], *, overlap_grad_reduce: bool,
                              live_throughout: Optional[int] = None) -> int:
    """Most full-gradient elements ZeRO-2 holds at once (besides its shards): a bucket's full
    storage exists from its first gradient to its reduce-scatter, which is issued as its last
    gradient is final, in every micro-batch; buckets fill in buffer order. Under
    ``--overlap-grad-reduce`` the previous bucket's reduce-scatter is in flight (its storage
    held) until the next one is launched. ``live_throughout``: a bucket written at the start of
    the backward and final only at its end (the tied embedding at PP = 1, which the output
    layer's gradient-accumulation fusion writes first; with ``--no-gradient-accumulation-fusion``
    autograd holds that gradient until the end instead, and this is an upper bound)."""
    best = 0
    for k in range(len(buckets)):
        live = {k} | ({k - 1} if overlap_grad_reduce and k else set())
        if live_throughout is not None:
            live.add(live_throughout)
        best = max(best, sum(buckets[i] for i in live))
    return best


def bucket_assignment(numels: List[int], dp: int, bucket_size: Optional[int] = None,
                      alone: Sequence[int] = ()) -> Tuple[List[int], List[int]]:
    """:func:`bucket_numels`'s buckets and, for each parameter (registration order), the index
    of its bucket: ``(bucket of each parameter, padded elements of each bucket)``."""
    sizes = bucket_numels(numels, dp, bucket_size, alone)
    if bucket_size is None:
        bucket_size = default_bucket_size(dp)
    of, bucket, cursor = [0] * len(numels), 0, 0
    for i in reversed(range(len(numels))):  # bucket_numels' walk, recording the bucket index
        if i in alone and cursor:
            bucket, cursor = bucket + 1, 0
        of[i] = bucket
        cursor += numels[i]
        if i in alone or cursor >= bucket_size:
            bucket, cursor = bucket + 1, 0
    return of, sizes


def interleaved_grad_window_numel(is_expert: Sequence[bool], dense: List[int], expert: List[int],
                                  *, dp: int, expert_dp: int, bucket_size: Optional[int] = None,
                                  overlap_grad_reduce: bool = False,
                                  tied_throughout: bool = False) -> int:
    """ZeRO-2's most full-gradient elements at once (besides the shards) when a stage has a
    dense and an expert buffer (MoE): the backward makes the parameters' gradients final in
    reverse registration order (``is_expert``: the two kinds' interleaving); a bucket of either
    buffer holds its full storage from its first gradient to its reduce-scatter, issued as its
    last gradient is final, so a dense and an expert bucket are live together while an MoE
    layer's backward fills both. Under ``--overlap-grad-reduce`` each buffer's previous bucket
    stays held until that buffer's next one is launched. ``tied_throughout``: the dense buffer's
    last bucket (the tied embedding at PP = 1) is live from the start (see
    :func:`sharded_grad_window_numel`). Expert buckets are padded to ``expert_dp``."""
    kinds = {False: bucket_assignment(dense, dp, bucket_size),
             True: bucket_assignment(expert, expert_dp, bucket_size)}
    left = {kind: [0] * len(sizes) for kind, (_, sizes) in kinds.items()}
    for kind, (of, _) in kinds.items():
        for b in of:
            left[kind][b] += 1
    position = {False: len(dense), True: len(expert)}
    live = {False: set(), True: set()}
    held = {False: None, True: None}  # the previous bucket, in flight under overlap
    best = 0
    for flag in reversed(is_expert):
        position[flag] -= 1
        of, sizes = kinds[flag]
        bucket = of[position[flag]]
        live[flag].add(bucket)
        now = set(live[False]) | ({len(kinds[False][1]) - 1} if tied_throughout else set())
        total = sum(kinds[False][1][b] for b in now | ({held[False]} - {None}))
        total += sum(kinds[True][1][b] for b in live[True] | ({held[True]} - {None}))
        best = max(best, total)
        left[flag][bucket] -= 1
        if not left[flag][bucket]:  # final: reduce-scattered
            live[flag].discard(bucket)
            held[flag] = bucket if overlap_grad_reduce else None
    return best


def zero3_unit_numels(config: ModelConfig, tp: int, pp: int, pp_rank: int, dp: int,
                      moe: Optional[MoEConfig] = None) -> List[int]:
    """Padded elements of ZeRO-3's units on one rank of stage ``pp_rank``
    (:mod:`megatron.core.distributed.param_units`): the root unit (embedding, final norm, output
    layer: one bucket, the tied copy at PP > 1 a bucket of its own) first, then one bucket per
    transformer layer, each padded to a multiple of ``dp``; dense parameters only (an MoE
    layer's experts: :func:`zero3_expert_unit_numels`). The units and the parameter with a
    bucket of its own are read from the stage built on the meta device
    (:func:`megatron.planner.inventory.stage_inventory`)."""
    pad = lambda n: -(-n // dp) * dp  # noqa: E731
    out = []
    for unit in stage_inventory(config, tp, pp, pp_rank, moe).units:  # dense: EP changes none
        alone = [n for n, own in unit if own]
        others = [n for n, own in unit if not own]
        out.append(sum(pad(n) for n in alone) + (pad(sum(others)) if others else 0))
    return out


def zero3_expert_unit_numels(config: ModelConfig, moe: MoEConfig, pp: int, pp_rank: int, ep: int,
                             etp: int, expert_dp: int) -> List[int]:
    """Padded elements of each transformer layer's expert bucket under ZeRO-3 (one per layer of
    stage ``pp_rank``, 0 for a dense layer): the layer's expert parameters on one EP and
    expert-TP rank, padded to a multiple of expert-DP (an MoE layer's unit gathers its dense
    bucket over DP x CP and its expert bucket over expert-DP)."""
    pad = lambda n: -(-n // expert_dp) * expert_dp  # noqa: E731
    stage_expert_numels(config, moe, pp, pp_rank, ep, etp)  # E % EP and f % expert-TP
    shapes = stage_inventory(config, 1, pp, pp_rank, moe, ep).expert_shapes
    return [pad(sum(math.prod(s) // etp for s in layer)) if layer else 0 for layer in shapes]


def _gather_window(layer_units: List[int]) -> int:
    """Most layer elements ZeRO-3 holds gathered at once besides the root unit: the layer
    computing and the next one, prefetched (in forward and backward alike, neighbours)."""
    if len(layer_units) < 2:
        return sum(layer_units)
    return max(a + b for a, b in zip(layer_units, layer_units[1:]))


def optimizer_state_bytes(numels: List[int], *, mixed_precision: bool, distributed: bool = False,
                          dp: int = 1, bucket_size: Optional[int] = None) -> int:
    """AdamW state of one rank.

    Without the distributed optimizer: torch AdamW's ``exp_avg`` and ``exp_avg_sq`` (fp32,
    8 bytes per element), its per-tensor ``step`` (a 4-byte fp32 scalar per parameter tensor),
    and, for bf16/fp16 models, the fp32 main parameters (4 bytes per element). With it
    (issue 4's accounting): ``8 * Psi_pad / N`` bytes, ``12 * Psi_pad / N`` with mixed precision,
    where ``Psi_pad`` is the padded grad buffer.
    """
    per_element = 12 if mixed_precision else 8
    if distributed:
        return per_element * grad_buffer_numel(numels, dp, bucket_size) // dp
    return per_element * sum(numels) + 4 * len(numels)


def expert_memory(config: ModelConfig, moe: Optional[MoEConfig], *, pp: int, pp_rank: int, ep: int,
                  etp: int, expert_dp: int, bf16: bool, use_distributed_optimizer: bool,
                  bucket_size: Optional[int] = None) -> Tuple[int, int, int, int]:
    """``(parameters, gradients, optimizer plain, optimizer distributed)`` bytes of stage
    ``pp_rank``'s experts on one rank: parameters ``e Psi_E`` (the padded buffer with the
    distributed optimizer), fp32 gradient buffer ``4 Psi_E_pad`` (buckets padded to a multiple
    of expert-DP), AdamW state as :func:`optimizer_state_bytes` over
    expert-DP."""
    numels = stage_expert_numels(config, moe, pp, pp_rank, ep, etp)
    if not numels:
        return 0, 0, 0, 0
    e = 2 if bf16 else 4
    padded = sum(bucket_numels(numels, expert_dp, bucket_size))
    params = e * (padded if use_distributed_optimizer else sum(numels))
    return (params, 4 * padded, optimizer_state_bytes(numels, mixed_precision=bf16),
            optimizer_state_bytes(numels, mixed_precision=bf16, distributed=True, dp=expert_dp,
                                  bucket_size=bucket_size))


def activation_bytes_per_layer(config: ModelConfig, seq_length: int, micro_batch_size: int, tp: int,
                               *, sequence_parallel: bool = False, recompute: str = "none",
                               dtype_bytes: int = 2) -> int:
    """Bytes one transformer layer saves for backward for one micro-batch on one rank.

    Korthikanti et al.'s ``sbh(34 + 5as/h)`` term by term, for our layer (element size e):

    * each RMSNorm: its input (``e sbh``: the layer input, or the residual after attention),
      fp32 ``1/rms`` (``4sb``) and its output, the next linear's input (``e sbh``); the
      normalised value is recomputed in backward;
    * attention: rotated queries (n heads) and keys (g heads), the values (g heads: SDPA shares
      each among n/g query heads, nothing is repeated), the output (``e sb(2n + 2g)d / t``) plus
      an fp32 log-sum-exp per head and token (``4bns / t``);
    * SwiGLU: the fused gate/up output (``2 e sbf / t``) and the product ``silu(gate) * up``
      (``e sbf / t``; ``silu(gate)`` is recomputed in backward);
    * dropout masks (1 byte per element, two of ``sbh``) only when ``hidden_dropout > 0``.

    Sequence parallelism divides the ``sbh`` terms by t (column linears keep the un-gathered
    input, as Megatron).

    ``selective`` is :mod:`megatron.model.recompute`'s default modules (``core_attn act
    layernorm``, no GEMM recomputed): each norm keeps only its input (``e sbh``: the layer input
    and the residual after attention), the attention core only the QKV output
    (``e sb(n + 2g)d / t``), the SwiGLU activation only the gate/up output (``2 e sbf / t``);
    every recomputed output is freed after its consumer ran. Dropout masks, if any, are kept.
    ``full`` is one layer of ``--recompute-method uniform --recompute-num-layers 1``: the layer
    input only (``e sbh``, /t with sequence parallelism); other full settings are counted by
    :func:`layers_activation_bytes`, the layers rebuilt during backward by
    :func:`stage_activation_bytes`.

    Raises:
        ValueError: an unknown ``recompute``.
    """
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute {recompute!r} is not one of {RECOMPUTE_CHOICES}")
    s, b, e, t = seq_length, micro_batch_size, dtype_bytes, tp
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    n, g = config.num_attention_heads // t, config.num_query_groups // t
    sbh = s * b * h / (t if sequence_parallel else 1)
    sb = s * b / (t if sequence_parallel else 1)
    dropout = 2 * sbh if config.hidden_dropout > 0 else 0
    if recompute == "full":
        return int(e * sbh)
    if recompute == "selective":
        return int(2 * e * sbh + e * s * b * (n + 2 * g) * d + 2 * e * s * b * f // t + dropout)
    norms = 2 * (2 * e * sbh + 4 * sb)
    attention = e * s * b * (2 * n + 2 * g) * d + 4 * b * n * s
    mlp = 3 * e * s * b * f // t
    return int(norms + attention + mlp + dropout)


def layers_activation_bytes(config: ModelConfig, seq_length: int, micro_batch_size: int, tp: int,
                            num_layers: int, *, sequence_parallel: bool = False,
                            recompute: str = "none", recompute_method: str = "uniform",
                            recompute_num_layers: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes ``num_layers`` consecutive layers (one stage or model chunk) save for backward for
    one micro-batch on one rank, as :func:`megatron.model.recompute.forward_layers` runs them.

    Full recompute keeps only each checkpointed group's input (``e sbh``, /t with sequence
    parallelism): ``uniform`` one per group of ``recompute_num_layers`` layers, ``block`` one
    per each of the first ``recompute_num_layers`` layers, the other layers keeping everything
    (as with no recompute). Other settings: ``num_layers`` times
    :func:`activation_bytes_per_layer`.

    Raises:
        ValueError: an unknown ``recompute`` or ``recompute_method``, or
            ``recompute_num_layers < 1``.
    """
    per_layer = dict(sequence_parallel=sequence_parallel, dtype_bytes=dtype_bytes)
    one = activation_bytes_per_layer(config, seq_length, micro_batch_size, tp, recompute=recompute,
                                     **per_layer)
    if recompute != "full":
        return one * num_layers
    if recompute_method not in ("uniform", "block") or recompute_num_layers < 1:
        raise ValueError(f"full recompute needs recompute_method uniform or block and "
                         f"recompute_num_layers >= 1 (got {recompute_method!r}, {recompute_num_layers})")
    if recompute_method == "uniform":
        return one * -(-num_layers // recompute_num_layers)
    checkpointed = min(recompute_num_layers, num_layers)
    none = activation_bytes_per_layer(config, seq_length, micro_batch_size, tp, **per_layer)
    return one * checkpointed + none * (num_layers - checkpointed)


def head_activation_bytes(config: ModelConfig, seq_length: int, micro_batch_size: int, tp: int,
                          dtype_bytes: int = 2) -> int:
    """Last stage: the final RMSNorm (as in a layer), the vocab-parallel cross entropy's fp32
    softmax ``4sbv/t`` and its target mask and ids (``9sb``)."""
    s, b, e, h = seq_length, micro_batch_size, dtype_bytes, config.hidden_size
    norm = 2 * e * s * b * h + 4 * s * b
    return int(norm + 4 * s * b * config.padded_vocab_size // tp + 9 * s * b)


def in_flight_microbatches(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches (in units of a whole stage's layers) the first pipeline stage holds at the
    peak of 1F1B: ``min(pp, m)``; interleaved with v chunks: ``pp * (1 + (pp - 1) / (pp * v))``
    (Korthikanti et al. section 4.2.3), capped at all m micro-batches."""
    if virtual_stages <= 1:
        return float(min(pp, num_microbatches))
    peak = pp * (1 + (pp - 1) / (pp * virtual_stages))
    return min(peak, float(num_microbatches))


def stage_activation_bytes(config: ModelConfig, seq_length: int, micro_batch_size: int, tp: int, pp: int,
                           num_microbatches: int, *, sequence_parallel: bool = False,
                           recompute: str = "none", recompute_method: str = "uniform",
                           recompute_num_layers: int = 1, dtype_bytes: int = 2) -> int:
    """Peak activation bytes of the busiest rank (the first stage for pp > 1; the single stage
    holds the head too when pp == 1). With full recompute, the layers of one checkpointed group
    (``recompute_num_layers`` for uniform, one for block) are rebuilt with all their
    intermediates during backward, on top of what the in-flight micro-batches keep."""
    layers = config.num_layers // pp
    common = dict(sequence_parallel=sequence_parallel, dtype_bytes=dtype_bytes)
    kept = layers_activation_bytes(config, seq_length, micro_batch_size, tp, layers, recompute=recompute,
                                   recompute_method=recompute_method,
                                   recompute_num_layers=recompute_num_layers, **common)
    total = kept * in_flight_microbatches(pp, num_microbatches)
    if recompute == "full":
        rebuilt = min(recompute_num_layers, layers) if recompute_method == "uniform" else 1
        total += rebuilt * activation_bytes_per_layer(config, seq_length, micro_batch_size, tp, **common)
    if pp == 1:
        total += head_activation_bytes(config, seq_length, micro_batch_size, tp, dtype_bytes)
    return int(total)


def moe_dispatch_activation_bytes(config: ModelConfig, moe: MoEConfig, *, seq_length: int,
                                  micro_batch_size: int, tp: int, cp: int, pp: int,
                                  pp_rank: int, micro_batches: float, ep: int, etp: int,
                                  sequence_parallel: bool = False, recompute: str = "none",
                                  recompute_method: str = "uniform",
                                  recompute_num_layers: int = 1, dtype_bytes: int = 2) -> int:
    """What the alltoall dispatch adds to stage ``pp_rank``'s activations on one rank: each MoE
    layer's :func:`~megatron.planner.moe.dispatch_saved_bytes` per micro-batch in flight
    (``micro_batches``; under full recompute only the layers rebuilt in backward keep it), plus
    one exchange's buffers (:func:`~megatron.planner.moe.dispatch_buffer_bytes`). ``seq_length``
    is this rank's ``s / CP``; the capacity's token set is the micro-batch's ``s b``. The
    allgather dispatcher is not modelled (0)."""
    layers = sum(stage_moe_layers(config, moe, pp, pp_rank))
    if not layers or moe.moe_token_dispatcher_type != "alltoall":
        return 0
    tokens = seq_length * micro_batch_size // (tp if sequence_parallel else 1)
    kw = dict(token_set=seq_length * cp * micro_batch_size,
              capacity_factor=moe.moe_expert_capacity_factor,
              pad_to_capacity=moe.moe_pad_expert_input_to_capacity, etp=etp)
    shape = (tokens, moe.moe_router_topk, config.hidden_size, dtype_bytes, moe.num_experts)
    one = dispatch_saved_bytes(*shape, ffn_hidden_size=moe.moe_ffn_hidden_size
                               or config.ffn_hidden_size, **kw)
    if recompute == "full":
        kept = min(recompute_num_layers if recompute_method == "uniform" else 1, layers)
    else:
        kept = layers * micro_batches
    return int(one * kept) + dispatch_buffer_bytes(*shape, ep=ep, **kw)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank of one layout (the busiest pipeline stage)."""

    parameters: int
    gradients: int
    optimizer: int
    optimizer_distributed: int
    activations: int
    use_distributed_optimizer: bool

    @property
    def total(self) -> int:
        opt = self.optimizer_distributed if self.use_distributed_optimizer else self.optimizer
        return self.parameters + self.gradients + opt + self.activations


def estimate_memory(config: ModelConfig, *, tp: int, pp: int, dp: int, seq_length: int,
                    micro_batch_size: int, num_microbatches: int, bf16: bool = True,
                    sequence_parallel: bool = False, recompute: str = "none",
                    recompute_method: str = "uniform", recompute_num_layers: int = 1,
                    use_distributed_optimizer: bool = False,
                    bucket_size: Optional[int] = None, cp: int = 1,
                    sharding_strategy: str = "optim",
                    overlap_grad_reduce: bool = False, moe: Optional[MoEConfig] = None,
                    ep: int = 1, etp: int = 1) -> MemoryEstimate:
    """Per-rank memory of the busiest stage: the max over stages of weights + optimizer (the
    first or last stage, which hold the embedding / output layer) with the first stage's
    activations (the most in-flight micro-batches). ``cp``: context-parallel size (activations
    of ``seq_length / cp`` tokens; gradient buffer and optimizer shards over ``dp x cp``).

    ``sharding_strategy`` (with ``use_distributed_optimizer``;
    ``--data-parallel-sharding-strategy``), gradients at their peak, parameters and optimizer state as held (``Psi_pad``: padded
    elements, ``N`` = DP x CP, ``e`` = 2 for bf16, 4 for fp32; gradients fp32):

    * ``optim`` (ZeRO-1): params ``e Psi_pad`` (the parameter buffer), grads ``4 Psi_pad``
      (the whole buffer, through the iteration), optimizer ``12 Psi_pad / N`` (bf16) or
      ``8 Psi_pad / N``;
    * ``optim_grads`` (ZeRO-2): params and optimizer as ZeRO-1, grads ``4 Psi_pad / N`` (the
      shards) + the full buckets held at once while reduce-scattered per micro-batch
      (:func:`sharded_grad_window_numel`, ``overlap_grad_reduce``);
    * ``optim_grads_params`` (ZeRO-3): params ``e Psi_pad / N`` + the gather window (the root
      unit and the largest two neighbouring layers: the one computing and the prefetched
      next), grads
      ``4 Psi_pad / N`` + the root unit's and the largest layer's full gradients (the root's
      live from the loss to the embedding, a layer's during its own backward), ``Psi_pad``
      padded per unit (:func:`zero3_unit_numels`).

    ``tests/unit/planner/test_planner_zero.py`` checks each against the storages of a built
    model at DP=2.

    A mixture-of-experts model (``moe``; ``ep`` = ``--expert-model-parallel-size``, ``etp`` =
    ``--expert-tensor-parallel-size``): the router and shared expert count as dense parameters,
    the stage's routed experts are added as :func:`expert_memory` gives
    them (their own buffer over expert-DP = TP x CP x DP / (EP x expert-TP); the stage chosen
    by dense and expert elements together) under ``optim`` (ZeRO-1) or no sharding; under
    ``optim_grads_params`` (ZeRO-3) each MoE layer's unit is its dense bucket (padded to DP x CP)
    and its expert bucket (:func:`zero3_expert_unit_numels`, padded to expert-DP): shards
    ``Psi_dense_pad / N + Psi_expert_pad / expert-DP``, the gather window the root unit and the
    largest two neighbouring layer units, the gradient peak the root and the largest layer unit
    (``tests/unit/planner/test_planner_moe.py`` against a built model at EP 1 and 2).
    ``optim_grads`` (ZeRO-2) with experts: the gradient shards of both buffers and the full
    buckets of both live at once along the backward (:func:`interleaved_grad_window_numel`).
    Activations of an MoE layer are estimated as those of a dense layer whose ffn width is the
    active one (top-k x expert width + shared expert; :func:`active_ffn_hidden_size`), plus what
    the alltoall dispatch keeps and its exchange buffers (:func:`moe_dispatch_activation_bytes`).

    Raises:
        ValueError: EP x expert-TP not dividing TP x CP x DP."""
    e = 2 if bf16 else 4
    expert_dp = expert_data_parallel_size(tp, cp, dp, ep, etp) if is_moe(moe) else 1
    seq_length, dp = seq_length // cp, dp * cp
    ranks = sorted({0, pp - 1})
    experts = {r: expert_memory(config, moe, pp=pp, pp_rank=r, ep=ep, etp=etp, expert_dp=expert_dp,
                                bf16=bf16, use_distributed_optimizer=use_distributed_optimizer,
                                bucket_size=default_bucket_size(dp) if bucket_size is None
                                else bucket_size) for r in ranks}
    stages = [param_numels(config, tp, pp, r, moe) for r in ranks]
    heaviest = max(range(len(ranks)), key=lambda i: e * sum(stages[i]) + experts[ranks[i]][0])
    numels, stage = stages[heaviest], ranks[heaviest]
    expert_params, expert_grads, expert_opt, expert_opt_dist = experts[stage]
    model_config = config
    if is_moe(moe):  # activations: a dense layer of the mean active width
        width = sum(active_ffn_hidden_sizes(config, moe))
        config = config.replace(ffn_hidden_size=width // config.num_layers)
    grads = 4 * grad_buffer_numel(numels, dp, bucket_size)  # fp32 main_grad buffer
    params = e * sum(numels)
    strategy = sharding_strategy if use_distributed_optimizer else "no_shard"
    psi_pad = None
    tied = not config.untie_embeddings_and_output_weights
    if strategy in ("optim", "optim_grads"):
        alone = [len(numels) - 1] if pp > 1 and tied and stage == pp - 1 else []
        buckets = bucket_numels(numels, dp, bucket_size, alone)
        psi_pad = sum(buckets)
        params, grads = e * psi_pad, 4 * psi_pad
        if strategy == "optim_grads" and is_moe(moe):  # two buffers' buckets interleave
            inventory = stage_inventory(model_config, tp, pp, stage, moe, ep)
            expert_numels = stage_expert_numels(model_config, moe, pp, stage, ep, etp)
            window = interleaved_grad_window_numel(
                inventory.is_expert, numels, expert_numels, dp=dp, expert_dp=expert_dp,
                bucket_size=default_bucket_size(dp) if bucket_size is None else bucket_size,
                overlap_grad_reduce=overlap_grad_reduce,
                tied_throughout=pp == 1 and tied and not alone)
            expert_grads = expert_grads // expert_dp  # the shards; full buckets in the window
            grads = 4 * psi_pad // dp + 4 * window
        elif strategy == "optim_grads":
            window = sharded_grad_window_numel(
                buckets, overlap_grad_reduce=overlap_grad_reduce,
                live_throughout=len(buckets) - 1 if pp == 1 and tied else None)
            grads = 4 * psi_pad // dp + 4 * window
    elif strategy == "optim_grads_params":
        units = zero3_unit_numels(model_config, tp, pp, stage, dp, moe if is_moe(moe) else None)
        psi_pad = sum(units)
        shards = psi_pad // dp
        layers = units[1:]
        if is_moe(moe):  # experts sharded over expert-DP, gathered with their layer's unit
            experts = zero3_expert_unit_numels(model_config, moe, pp, stage, ep, etp, expert_dp)
            shards += sum(experts) // expert_dp
            layers = [d + x for d, x in zip(layers, experts)]
            expert_params = expert_grads = expert_opt_dist = 0
        grads = 4 * shards + 4 * (units[0] + max(layers, default=0))
        params = e * shards + e * (units[0] + _gather_window(layers))
        psi_pad = shards * dp  # the optimizer's shards below
    rc = dict(recompute=recompute, recompute_method=recompute_method,
              recompute_num_layers=recompute_num_layers)
    act = stage_activation_bytes(config, seq_length, micro_batch_size, tp, pp, num_microbatches,
                                 sequence_parallel=sequence_parallel, dtype_bytes=e, **rc)
    dispatch = {}
    if is_moe(moe):  # the dispatched copies and the all-to-all's buffers (alltoall)
        for rank, in_flight in ((0, in_flight_microbatches(pp, num_microbatches)), (pp - 1, 1)):
            dispatch[rank] = moe_dispatch_activation_bytes(
                model_config, moe, seq_length=seq_length, micro_batch_size=micro_batch_size,
                tp=tp, cp=cp, pp=pp, pp_rank=rank, micro_batches=in_flight, ep=ep, etp=etp,
                sequence_parallel=sequence_parallel, dtype_bytes=e, **rc)
        act += dispatch[0]
    if pp > 1:  # the last stage holds the head's activations for its micro-batch
        last = (layers_activation_bytes(config, seq_length, micro_batch_size, tp, config.num_layers // pp,
                                        sequence_parallel=sequence_parallel, dtype_bytes=e, **rc)
                + head_activation_bytes(config, seq_length, micro_batch_size, tp, e)
                + dispatch.get(pp - 1, 0))
        act = max(act, last)
    return MemoryEstimate(
        parameters=params + expert_params, gradients=grads + expert_grads,
        optimizer=optimizer_state_bytes(numels, mixed_precision=bf16) + expert_opt,
        optimizer_distributed=expert_opt_dist + (
            optimizer_state_bytes(numels, mixed_precision=bf16, distributed=True, dp=dp,
                                  bucket_size=bucket_size)
            if psi_pad is None else (12 if bf16 else 8) * psi_pad // dp),
        activations=act, use_distributed_optimizer=use_distributed_optimizer)
