"""Enumerate (TP, CP, PP, DP, micro-batch, recompute, sequence parallel, distributed optimizer)
layouts and rank the ones that fit by an estimated iteration time.

The cost model (deliberately simple; every term is printed so a user can disagree with it):

* compute: Megatron's model FLOPs of the iteration (:func:`megatron.model.flops.num_floating_point_operations`)
  plus recompute FLOPs (full: one more forward of the layers, i.e. 1/3 of their training FLOPs;
  selective: the attention core's forward), divided by ``gpus * peak * mfu``;
  with pipeline parallelism the time of the slowest stage: the last, which adds the output
  layer's logits (``6 B s h v`` of Megatron's formula; its loss is negligible in FLOPs) to its
  share of the layers (the first stage's embedding lookup costs memory, which
  :mod:`megatron.planner.memory` counts, but no FLOPs); every stage waits for the slowest;
* pipeline bubble: that slowest stage's time times ``(p - 1) / m``, i.e. the bubble is
  ``(p - 1) / (m + p - 1)`` of the iteration (Narayanan et al. 2021, section 2.2);
* tensor-parallel communication, fully exposed: per layer and micro-batch 4 ring all-reduces
  (2 forward, 2 backward; 2 more forward with full recompute) of ``s * b * h`` activations, or the
  equivalent all-gather / reduce-scatter pairs with sequence parallelism, each moving
  ``2 (t - 1) / t`` of the bytes at the intra-node bandwidth;
* pipeline point-to-point: ``2 (m + p - 1)`` transfers of ``s * b * h`` activations on the
  critical path, at the inter-node bandwidth when stages span nodes;
* context parallelism (``c`` ranks per sequence; every ``s`` above is then ``s / c``, the
  per-rank tokens), fully exposed (an upper bound: the ring overlaps each transfer with a
  block's attention): per layer and micro-batch ``(c - 1)`` key/value blocks
  (``2 e b (s / c) g d / t`` bytes) forward, again in backward plus as many fp32 ``dK``/``dV``
  blocks, one more forward with full recompute (the same volume for ``p2p`` and
  ``all_gather``), at the intra-node bandwidth while ``t * c`` ranks fit a node;
* data-parallel gradient reduction once per iteration, over the ``d x c`` ranks holding replicas:
  a ring all-reduce of the fp32 grad buffer (``2 (n - 1) / n * 4 Psi`` bytes, ``n = d c``), or
  with the distributed optimizer a reduce-scatter of fp32 gradients plus an all-gather of the
  parameters (``(n - 1) / n * (4 + e) Psi``); the backward of the last micro-batch hides it
  (overlap) and the rest is exposed;
* mixture of experts (``moe``; :mod:`megatron.planner.moe`): compute counts the active FLOPs
  (``num_floating_point_operations(..., moe)``: top-k experts and the shared expert); the
  expert parameters ``Psi_E`` reduce like the dense ones but over expert-DP
  (``TP x CP x DP / (EP x expert-TP)``), added to the DP term; the token dispatcher's
  all-to-all (:func:`~megatron.planner.moe.alltoall_bytes_per_iteration`, 4 exchanges per MoE
  layer and micro-batch, 6 with full recompute) is fully exposed, at the intra-node bandwidth
  while the ``EP x expert-TP`` ranks of an expert group fit a node. EP is searched over the
  divisors of ``--num-experts`` with EP x expert-TP dividing TP x CP x DP; expert-TP is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional

from megatron.config import ModelConfig
from megatron.model.flops import num_floating_point_operations
from megatron.tokenizer.tokenizer import vocab_size_with_padding
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.planner.memory import RECOMPUTE_CHOICES, MemoryEstimate, estimate_memory, param_numels
from megatron.planner.moe import (alltoall_bytes_per_iteration, expert_data_parallel_size, is_moe,
                                  stage_expert_numels, stage_moe_layers)


@dataclass(frozen=True)
class Hardware:
    """The cluster: GPUs per node, memory (bytes) and dense bf16 peak (FLOP/s) per GPU, assumed
    MFU, link bandwidths (bytes/s per GPU) and memory kept back for the CUDA context, NCCL
    buffers and allocator fragmentation (bytes)."""

    num_gpus: int
    gpu_memory: float
    peak_flops: float = 989e12
    mfu: float = 0.45
    gpus_per_node: int = 8
    intra_node_bandwidth: float = 200e9
    inter_node_bandwidth: float = 25e9
    reserved_memory: float = 4 * 2 ** 30


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    recompute: str
    sequence_parallel: bool
    use_distributed_optimizer: bool
    cp: int = 1
    """Context-parallel size: ranks each sequence is split over (``--context-parallel-size``)."""
    ep: int = 1
    """Expert-parallel size (``--expert-model-parallel-size``); 1 for a dense model."""
    etp: int = 1
    """Expert-tensor-parallel size (``--expert-tensor-parallel-size``)."""


@dataclass(frozen=True)
class Estimate:
    """One layout's memory and iteration time (seconds) split into its terms."""

    layout: Layout
    memory: MemoryEstimate
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    fits: bool
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    """The expert dispatcher's all-to-all (0 for a dense model)."""

    @property
    def iteration_s(self) -> float:
        return (self.compute_s + self.bubble_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s
                + self.cp_comm_s + self.ep_comm_s)


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tensor_parallel_sizes(config: ModelConfig, gpus_per_node: int) -> List[int]:
    """TP sizes that split heads, groups and the ffn evenly and stay inside one node."""
    return [t for t in _divisors(gpus_per_node) if config.num_attention_heads % t == 0
            and config.num_query_groups % t == 0 and config.ffn_hidden_size % t == 0]


def config_for_tp(config: ModelConfig, tp: int, vocab_size: Optional[int],
                  make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """``config`` with the vocabulary padded for ``tp`` as the tokenizer pads it
    (``vocab_size_with_padding``); unchanged when ``vocab_size`` is None."""
    if vocab_size is None:
        return config
    return config.replace(padded_vocab_size=vocab_size_with_padding(
        vocab_size, make_vocab_size_divisible_by, tp))


def context_parallel_sizes(num_gpus: int, seq_length: Optional[int]) -> List[int]:
    """CP sizes: divisors of the GPU count splitting ``seq_length`` into ``2 CP`` equal chunks
    (only 1 when ``seq_length`` is None)."""
    if seq_length is None:
        return [1]
    return [c for c in _divisors(num_gpus) if seq_length % (2 * c) == 0 or c == 1]


def expert_parallel_sizes(moe: Optional[MoEConfig], stage_ranks: int, etp: int = 1) -> List[int]:
    """EP sizes: divisors of ``--num-experts`` with ``EP x etp`` dividing the ``stage_ranks``
    (TP x CP x DP); ``[1]`` for a dense model."""
    if not is_moe(moe):
        return [1]
    return [ep for ep in _divisors(moe.num_experts) if stage_ranks % (ep * etp) == 0]


def enumerate_layouts(config: ModelConfig, hw: Hardware, global_batch_size: int,
                      seq_length: Optional[int] = None, moe: Optional[MoEConfig] = None,
                      etp: Optional[int] = None) -> Iterator[Layout]:
    """Every layout with TP x CP x PP x DP = GPUs, layers divisible by PP, global batch divisible
    by micro-batch x DP, micro-batch a power of two; CP > 1 only given ``seq_length`` (split in
    ``2 CP`` chunks, and in ``2 CP TP`` with sequence parallelism); with ``moe`` every EP of
    :func:`expert_parallel_sizes` at expert-TP ``etp`` (None: each layout's TP, Megatron-Core's
    default of ``--expert-tensor-parallel-size``)."""
    for tp in tensor_parallel_sizes(config, min(hw.gpus_per_node, hw.num_gpus)):
        if hw.num_gpus % tp:
            continue
        etp_of = tp if etp is None else etp
        if etp is None and is_moe(moe) and (moe.moe_ffn_hidden_size or config.ffn_hidden_size) % tp:
            continue  # the default expert-TP (= TP) must split the expert width
        for cp in context_parallel_sizes(hw.num_gpus // tp, seq_length):
            for pp in _divisors(hw.num_gpus // (tp * cp)):
                if config.num_layers % pp:
                    continue
                dp = hw.num_gpus // (tp * cp * pp)
                if global_batch_size % dp:
                    continue
                per_replica = global_batch_size // dp
                sps = [sp for sp in ((False, True) if tp > 1 else (False,))
                       if not (sp and cp > 1 and seq_length % (2 * cp * tp))]
                mbs = 1
                while mbs <= per_replica:
                    if per_replica % mbs == 0:
                        for recompute in RECOMPUTE_CHOICES:
                            for sp in sps:
                                for dist_opt in ((False, True) if dp * cp > 1 else (False,)):
                                    for ep in expert_parallel_sizes(moe, tp * cp * dp, etp_of):
                                        yield Layout(tp, pp, dp, mbs, per_replica // mbs, recompute,
                                                     sp, dist_opt, cp, ep, etp_of if is_moe(moe) else 1)
                    mbs *= 2


def _ring(bytes_: float, n: int, bandwidth: float, factor: float = 2.0) -> float:
    return factor * (n - 1) / n * bytes_ / bandwidth if n > 1 else 0.0


def estimate(config: ModelConfig, layout: Layout, hw: Hardware, seq_length: int,
             bf16: bool = True, bucket_size: Optional[int] = None,
             moe: Optional[MoEConfig] = None) -> Estimate:
    """Memory and iteration time of ``layout`` under the module's cost model (``moe``: the
    mixture-of-experts section, None for a dense model)."""
    L = layout
    e = 2 if bf16 else 4
    gbs = L.micro_batch_size * L.num_microbatches * L.dp
    model_flops = num_floating_point_operations(config, gbs, seq_length, moe)
    flops = model_flops
    layer_flops = num_floating_point_operations(config.replace(padded_vocab_size=0), gbs, seq_length,
                                                moe)
    if L.recompute == "full":
        flops += layer_flops / 3
    elif L.recompute == "selective":  # forward of scores and context: 4 s^2 (n d) per layer and sample
        flops += 4.0 * gbs * seq_length ** 2 * config.num_attention_heads * config.kv_channels * config.num_layers
    # The last stage adds the output layer to its share of the layers; all stages wait for it.
    head_flops = model_flops - layer_flops
    slowest_stage_flops = (flops - head_flops) / L.pp + head_flops
    compute = slowest_stage_flops / (L.tp * L.cp * L.dp * hw.peak_flops * hw.mfu)
    bubble = compute * (L.pp - 1) / L.num_microbatches

    local_seq = seq_length // L.cp  # tokens of each sequence on one context-parallel rank
    act_bytes = local_seq * L.micro_batch_size * config.hidden_size * e
    collectives = 4 + (2 if L.recompute == "full" else 0)
    layer_steps = (config.num_layers // L.pp) * L.num_microbatches
    tp_comm = layer_steps * collectives * _ring(act_bytes, L.tp, hw.intra_node_bandwidth)
    # Pipeline neighbours are TP x CP x DP ranks apart (Megatron-Core's rank order).
    replicas = L.dp * L.cp
    stages_cross_nodes = hw.num_gpus > hw.gpus_per_node and L.tp * replicas >= hw.gpus_per_node
    pp_bw = hw.inter_node_bandwidth if stages_cross_nodes else hw.intra_node_bandwidth
    pp_comm = 2 * (L.num_microbatches + L.pp - 1) * act_bytes / pp_bw if L.pp > 1 else 0.0
    cp_comm = 0.0
    if L.cp > 1:
        kv_block = 2 * L.micro_batch_size * local_seq * config.num_query_groups // L.tp * config.kv_channels
        forwards = 2 if L.recompute == "full" else 1
        per_layer = (L.cp - 1) * kv_block * ((forwards + 1) * e + 4)
        cp_bw = hw.intra_node_bandwidth if L.tp * L.cp <= hw.gpus_per_node else hw.inter_node_bandwidth
        cp_comm = layer_steps * per_layer / cp_bw

    psi = sum(max((param_numels(config, L.tp, L.pp, r, moe) for r in {0, L.pp - 1}), key=sum))
    dp_bw = hw.intra_node_bandwidth if L.tp * replicas <= hw.gpus_per_node else hw.inter_node_bandwidth

    def reduction(numel, n, bw):
        if L.use_distributed_optimizer:
            return _ring((4 + e) * numel, n, bw, factor=1.0)
        return _ring(4 * numel, n, bw)

    dp_total = reduction(psi, replicas, dp_bw)
    ep_comm = 0.0
    if is_moe(moe):
        stages = range(L.pp)
        psi_e = max(sum(stage_expert_numels(config, moe, L.pp, r, L.ep, L.etp)) for r in stages)
        expert_dp = expert_data_parallel_size(L.tp, L.cp, L.dp, L.ep, L.etp)
        group = L.ep * L.etp  # an expert-DP group's ranks are this far apart
        edp_bw = (hw.intra_node_bandwidth if group * expert_dp <= hw.gpus_per_node
                  else hw.inter_node_bandwidth)
        dp_total += reduction(psi_e, expert_dp, edp_bw)
        tokens = local_seq * L.micro_batch_size * L.num_microbatches
        if L.sequence_parallel:
            tokens //= L.tp
        layers = max(sum(stage_moe_layers(config, moe, L.pp, r)) for r in stages)
        a2a = alltoall_bytes_per_iteration(tokens, moe.moe_router_topk, config.hidden_size, e,
                                           L.ep, layers) * (1.5 if L.recompute == "full" else 1.0)
        ep_bw = hw.intra_node_bandwidth if group <= hw.gpus_per_node else hw.inter_node_bandwidth
        ep_comm = a2a / ep_bw
    last_backward = compute / L.num_microbatches * 2 / 3  # backward of the last micro-batch
    dp_comm = max(0.0, dp_total - last_backward)

    mem = estimate_memory(config, tp=L.tp, pp=L.pp, dp=L.dp, seq_length=seq_length,
                          micro_batch_size=L.micro_batch_size, num_microbatches=L.num_microbatches,
                          bf16=bf16, sequence_parallel=L.sequence_parallel, recompute=L.recompute,
                          use_distributed_optimizer=L.use_distributed_optimizer, bucket_size=bucket_size,
                          cp=L.cp, moe=moe, ep=L.ep, etp=L.etp)
    fits = mem.total + hw.reserved_memory <= hw.gpu_memory
    return Estimate(L, mem, compute, bubble, tp_comm, pp_comm, dp_comm, fits, cp_comm, ep_comm)


def distinct(ranked: List[Estimate]) -> List[Estimate]:
    """``ranked`` without the rows another row makes redundant: the same sizes, micro-batch and
    recompute, differing only in the distributed optimizer or sequence parallelism where that
    changes no time in the model (hidden DP traffic, the same TP traffic), with no less memory.
    Order kept."""
    best = {}
    for r in ranked:
        L = r.layout
        key = (L.tp, L.cp, L.pp, L.dp, L.ep, L.micro_batch_size, L.recompute, round(r.iteration_s, 9))
        if key not in best or r.memory.total < best[key].memory.total:
            best[key] = r
    kept = {id(r) for r in best.values()}
    return [r for r in ranked if id(r) in kept]


def rank_layouts(config: ModelConfig, hw: Hardware, global_batch_size: int, seq_length: int,
                 bf16: bool = True, allow_sequence_parallel: bool = True,
                 vocab_size: Optional[int] = None, make_vocab_size_divisible_by: int = 128,
                 allow_context_parallel: bool = True, moe: Optional[MoEConfig] = None,
                 expert_tensor_parallel_size: Optional[int] = None) -> List[Estimate]:
    """Feasible layouts, fastest first (ties: less memory first), without redundant rows
    (:func:`distinct`). ``moe``: a mixture-of-experts model (EP searched, expert-TP
    ``expert_tensor_parallel_size``; None: each layout's TP, as Megatron-Core's default).

    ``vocab_size`` (unpadded) re-pads the vocabulary for each TP size, as training would;
    without it ``config.padded_vocab_size`` is used for every layout.

    Raises:
        ValueError: when no layout exists at all for these sizes (e.g. a global batch that no
            data-parallel size divides), naming the flags to change.
    """
    layouts = [l for l in enumerate_layouts(config, hw, global_batch_size,
                                            seq_length if allow_context_parallel else None,
                                            moe, expert_tensor_parallel_size)
               if (allow_sequence_parallel or not l.sequence_parallel)
               # a MoE layer at TP > 1 needs SP, as training does (each tensor rank routes its share)
               and (moe is None or l.tp == 1 or l.sequence_parallel)]
    if not layouts:
        raise ValueError(f"no TP x PP x DP layout of {hw.num_gpus} GPUs divides --num-layers "
                         f"({config.num_layers}) and --global-batch-size ({global_batch_size}); "
                         "change --num-gpus or --global-batch-size")
    # one config object per TP: the stage inventories are cached by it
    configs = {tp: config_for_tp(config, tp, vocab_size, make_vocab_size_divisible_by)
               for tp in {l.tp for l in layouts}}
    results = [estimate(configs[l.tp], l, hw, seq_length, bf16, moe=moe) for l in layouts]
    return distinct(sorted((r for r in results if r.fits),
                           key=lambda r: (r.iteration_s, r.memory.total)))
