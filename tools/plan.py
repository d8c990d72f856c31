"""Plan a LLaMA training layout before launching: per-rank memory and the fastest layouts that fit.

Example (LLaMA-2 7B on 8 x 80 GB)::

    python tools/plan.py --hf-config path/to/config.json --num-gpus 8 --gpu-memory-gib 80 \\
        --global-batch-size 256 --seq-length 4096

or with Megatron's model flags (``--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008
--num-attention-heads 32 --vocab-size 32000 ...``); a mixture-of-experts model with
Megatron-Core's MoE flags (``--num-experts 8 --moe-router-topk 2 ...``; the expert-parallel
size is searched, ``--expert-tensor-parallel-size`` is given). It prints the ranked layouts (TP, CP, PP, DP,
micro-batch, recompute, sequence parallel, distributed optimizer) with their estimated memory and
iteration time, the memory breakdown of the best one for every recompute / sequence-parallel
setting, and the launch flags of the best one. The memory and cost models are documented in
``megatron/planner/memory.py`` and ``megatron/planner/cost.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.arguments.moe import _layer_freq_arg, moe_layer_pattern  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.core.transformer.moe.moe_config import MoEConfig  # noqa: E402
from megatron.usage_error import UsageError  # noqa: E402
from megatron.planner.cost import Hardware, config_for_tp, rank_layouts  # noqa: E402
from megatron.planner.memory import RECOMPUTE_CHOICES, estimate_memory  # noqa: E402
from megatron.planner.llama4 import SHAPES, VOCAB as LLAMA4_VOCAB, parameter_counts  # noqa: E402

# Llama 4's router and attention flags (docs/llama4.md), added to a --model's launch flags;
# Scout also has the q/k L2 norm and Llama-3 RoPE scaling (factor 16, low = high = 1)
LLAMA4_FLAGS = ["--moe-router-score-function sigmoid", "--moe-apply-probs-on-input",
                "--rotary-interleaved", "--no-rope-freq 4", "--attention-chunk-size 8192",
                "--attn-temperature-tuning", "--rotary-base 500000", "--norm-epsilon 1e-5"]
SCOUT_FLAGS = ["--qk-l2-norm", "--use-rope-scaling --rope-scaling-factor 16 "
               "--rope-scaling-low-freq-factor 1 --rope-scaling-high-freq-factor 1 "
               "--rope-scaling-original-max-position-embeddings 8192"]

GIB = 2 ** 30


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    m = p.add_argument_group("model (Megatron flags, or --hf-config)")
    m.add_argument("--hf-config", help="a HuggingFace LLaMA config.json (overrides the model flags)")
    m.add_argument("--model", choices=sorted(SHAPES),
                   help="a known shape (overrides the model and MoE flags; docs/llama4.md)")
    m.add_argument("--num-layers", type=int)
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--ffn-hidden-size", type=int)
    m.add_argument("--num-attention-heads", type=int)
    m.add_argument("--num-query-groups", type=int, default=None, help="GQA groups (default: heads)")
    m.add_argument("--kv-channels", type=int, default=None)
    m.add_argument("--vocab-size", type=int, default=32000, help="unpadded tokenizer vocabulary")
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    e = p.add_argument_group("mixture of experts (Megatron-Core's flags)")
    e.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer")
    e.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's SwiGLU width (default --ffn-hidden-size)")
    e.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    e.add_argument("--moe-layer-freq", type=_layer_freq_arg, default=1,
                   help="every N-th layer is MoE (N), or a 0/1 pattern such as '([1]*3+[0]*1)*2'")
    e.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="the shared expert's SwiGLU width")
    e.add_argument("--moe-shared-expert-gate", action="store_true", help="gated shared expert")
    e.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="expert-TP (default: each layout's TP, as Megatron-Core; the "
                        "expert-parallel size is searched)")
    t = p.add_argument_group("training")
    t.add_argument("--global-batch-size", type=int, required=True)
    t.add_argument("--seq-length", type=int, required=True)
    t.add_argument("--fp32", action="store_true", help="fp32 model (default: --bf16)")
    t.add_argument("--no-sequence-parallel", action="store_true", help="do not consider --sequence-parallel")
    t.add_argument("--no-context-parallel", action="store_true",
                   help="do not consider --context-parallel-size > 1")
    h = p.add_argument_group("hardware and cost model")
    h.add_argument("--num-gpus", type=int, required=True)
    h.add_argument("--gpus-per-node", type=int, default=8)
    h.add_argument("--gpu-memory-gib", type=float, required=True)
    h.add_argument("--reserved-gib", type=float, default=4.0,
                   help="kept back for CUDA context, NCCL buffers, fragmentation (GiB)")
    h.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100: 989)")
    h.add_argument("--mfu", type=float, default=0.45, help="assumed model FLOP utilisation of compute")
    h.add_argument("--intra-node-bandwidth", type=float, default=200.0, help="GB/s per GPU (NVLink)")
    h.add_argument("--inter-node-bandwidth", type=float, default=25.0, help="GB/s per GPU (network)")
    p.add_argument("--top", type=int, default=10, help="layouts to list")
    args = p.parse_args(argv)
    if args.hf_config is None and args.model is None:
        missing = [f for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
                   if getattr(args, f) is None]
        if missing:
            p.error("give --model, --hf-config or the model flags; missing: "
                    + ", ".join("--" + f.replace("_", "-") for f in missing))
    for flag in ("num_gpus", "global_batch_size", "seq_length"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if not 0 < args.mfu <= 1:
        p.error(f"--mfu ({args.mfu}) must be in (0, 1]")
    if args.num_experts is not None and not (args.num_experts >= 1
                                             and 1 <= args.moe_router_topk <= args.num_experts):
        p.error(f"--num-experts ({args.num_experts}) must be >= 1 and --moe-router-topk "
                f"({args.moe_router_topk}) between 1 and it")
    if args.expert_tensor_parallel_size is not None and args.expert_tensor_parallel_size < 1:
        p.error(f"--expert-tensor-parallel-size ({args.expert_tensor_parallel_size}) must be >= 1")
    return args


# A HuggingFace MoE config's fields (Mixtral, Qwen2/3-MoE, OLMoE) for the MoE flags left unset.
HF_MOE_FIELDS = {"num_experts": ("num_local_experts", "num_experts"),
                 "moe_router_topk": ("num_experts_per_tok",),
                 "moe_ffn_hidden_size": ("moe_intermediate_size",),
                 "moe_shared_expert_intermediate_size": ("shared_expert_intermediate_size",)}


def moe_from_hf_config(args) -> None:
    """Fill the MoE flags the command line left at their defaults from ``--hf-config``'s
    mixture-of-experts fields (:data:`HF_MOE_FIELDS`); a dense config changes nothing."""
    if not args.hf_config or args.num_experts is not None:
        return
    with open(args.hf_config) as f:
        hf = json.load(f)
    for dest, names in HF_MOE_FIELDS.items():
        value = next((hf[n] for n in names if hf.get(n)), None)
        if value is not None:
            setattr(args, dest, value)


def moe_from_args(args, num_layers: int):
    """The :class:`MoEConfig` of the MoE flags (None for a dense model).

    Raises:
        UsageError: a --moe-layer-freq pattern that does not match the layers."""
    if args.model:
        return SHAPES[args.model][1]
    moe_from_hf_config(args)
    if args.num_experts is None:
        return None
    return MoEConfig(num_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                     moe_router_topk=args.moe_router_topk,
                     moe_layer_freq=moe_layer_pattern(args.moe_layer_freq, num_layers),
                     moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                     moe_shared_expert_gate=args.moe_shared_expert_gate)


def model_from_hf_config(path: str) -> tuple:
    """``(ModelConfig, vocab_size)`` from a HuggingFace LLaMA ``config.json``.

    Raises:
        ValueError: the file lacks a field a LLaMA config has, naming it and the file.
    """
    with open(path) as f:
        hf = json.load(f)
    try:
        heads = hf["num_attention_heads"]
        config = ModelConfig(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads", heads),
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
            padded_vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False))
    except KeyError as err:
        raise ValueError(f"{path}: missing {err.args[0]!r}; expected a LLaMA config.json "
                         "(num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, "
                         "vocab_size)") from None
    return config, hf["vocab_size"]


def model_from_args(args) -> tuple:
    if args.model:
        moe = SHAPES[args.model][1]  # the launch flags read the MoE flags' values
        for dest in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq",
                     "moe_shared_expert_intermediate_size"):
            setattr(args, dest, getattr(moe, dest))
        return SHAPES[args.model][0], LLAMA4_VOCAB
    if args.hf_config:
        return model_from_hf_config(args.hf_config)
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, padded_vocab_size=args.vocab_size,
        max_position_embeddings=args.seq_length,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights), args.vocab_size


def launch_flags(config: ModelConfig, est, args) -> str:
    """The layout and model flags for ``pretrain_llama.py`` (data, tokenizer, lr left to the user)."""
    L = est.layout
    flags = [f"--tensor-model-parallel-size {L.tp}", f"--pipeline-model-parallel-size {L.pp}"]
    if args.num_experts is not None:
        flags += [f"--expert-model-parallel-size {L.ep}",
                  f"--expert-tensor-parallel-size {L.etp}", f"--num-experts {args.num_experts}",
                  f"--moe-router-topk {args.moe_router_topk}"]
        if args.moe_ffn_hidden_size:
            flags.append(f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size}")
        freq = args.moe_layer_freq
        if freq != 1:
            text = freq if isinstance(freq, int) else "'[" + ",".join(map(str, freq)) + "]'"
            flags.append(f"--moe-layer-freq {text}")
        if args.moe_shared_expert_intermediate_size:
            flags.append(f"--moe-shared-expert-intermediate-size "
                         f"{args.moe_shared_expert_intermediate_size}")
        if args.moe_shared_expert_gate:
            flags.append("--moe-shared-expert-gate")
    if args.model:  # Llama 4's router and attention (docs/llama4.md)
        flags += LLAMA4_FLAGS + (SCOUT_FLAGS if args.model == "llama4-scout" else [])
    if L.cp > 1:  # the split attention has no dropout
        flags += [f"--context-parallel-size {L.cp}", "--cp-comm-type p2p", "--attention-dropout 0.0"]
    flags += [
             f"--micro-batch-size {L.micro_batch_size}", f"--global-batch-size {args.global_batch_size}",
             f"--seq-length {args.seq_length}", f"--num-layers {config.num_layers}",
             f"--hidden-size {config.hidden_size}", f"--ffn-hidden-size {config.ffn_hidden_size}",
             f"--num-attention-heads {config.num_attention_heads}"]
    if config.num_query_groups != config.num_attention_heads:
        flags += ["--group-query-attention", f"--num-query-groups {config.num_query_groups}"]
    if config.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if not args.fp32:
        flags.append("--bf16")
    if L.sequence_parallel:
        flags.append("--sequence-parallel")
    if L.recompute != "none":
        flags.append(f"--recompute-granularity {L.recompute}")
        if L.recompute == "full":
            flags += ["--recompute-method uniform", "--recompute-num-layers 1"]
    if L.use_distributed_optimizer:
        flags += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    return " \\\n    ".join(flags)


def assumptions(args) -> str:
    """The cost model's assumptions, printed with its results (each a flag to change)."""
    return ("assumptions: peak {:g} TFLOP/s per GPU (--peak-tflops), model FLOP utilisation of "
            "compute {:g} (--mfu), links {:g} GB/s per GPU within a node of {} GPUs "
            "(--intra-node-bandwidth, --gpus-per-node) and {:g} GB/s across nodes "
            "(--inter-node-bandwidth), {:g} GiB per GPU kept back (--reserved-gib); the last "
            "pipeline stage computes the output layer besides its layers and sets the pace, the "
            "first holds the embedding; layouts are ranked with ZeRO-1 (the distributed optimizer), "
            "ZeRO-2/3's memory is shown for the best one and ZeRO-3's extra all-gathers are not "
            "in the times"
            ).format(args.peak_tflops, args.mfu, args.intra_node_bandwidth, args.gpus_per_node,
                     args.inter_node_bandwidth, args.reserved_gib)


def _gib(n: float) -> str:
    return f"{n / GIB:7.2f}"


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        config, vocab = model_from_args(args)
        moe = moe_from_args(args, config.num_layers)
    except (OSError, ValueError, UsageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    hw = Hardware(num_gpus=args.num_gpus, gpu_memory=args.gpu_memory_gib * GIB,
                  peak_flops=args.peak_tflops * 1e12, mfu=args.mfu, gpus_per_node=args.gpus_per_node,
                  intra_node_bandwidth=args.intra_node_bandwidth * 1e9,
                  inter_node_bandwidth=args.inter_node_bandwidth * 1e9,
                  reserved_memory=args.reserved_gib * GIB)
    bf16 = not args.fp32
    try:
        ranked = rank_layouts(config, hw, args.global_batch_size, args.seq_length, bf16,
                              allow_sequence_parallel=not args.no_sequence_parallel,
                              vocab_size=vocab, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                              allow_context_parallel=not args.no_context_parallel, moe=moe,
                              expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tokens = args.global_batch_size * args.seq_length
    print(f"model: {config.num_layers} layers, hidden {config.hidden_size}, ffn {config.ffn_hidden_size}, "
          f"{config.num_attention_heads} heads / {config.num_query_groups} groups, vocab {vocab}; "
          f"{args.num_gpus} GPUs x {args.gpu_memory_gib:g} GiB ({args.reserved_gib:g} reserved); "
          f"global batch {args.global_batch_size} x {args.seq_length} tokens, {'bf16' if bf16 else 'fp32'}")
    total, active = parameter_counts(config.replace(padded_vocab_size=vocab), moe)
    print(f"parameters: {total / 1e9:.2f} B total, {active / 1e9:.2f} B active per token")
    if moe is not None:
        print(f"mixture of experts: {moe.num_experts} experts, top-{moe.moe_router_topk}, expert "
              f"ffn {moe.moe_ffn_hidden_size or config.ffn_hidden_size}, shared expert "
              f"{moe.moe_shared_expert_intermediate_size or 0}, {sum(moe.moe_layer_freq)} of "
              f"{config.num_layers} layers MoE; EP searched, expert-TP "
              f"{args.expert_tensor_parallel_size or 'TP (default)'}")
    print(assumptions(args))
    if not ranked:
        print("no layout fits: add GPUs, lower --seq-length, or use GPUs with more memory")
        return 1
    print(f"\n{len(ranked)} layouts fit; the fastest {min(args.top, len(ranked))} "
          "(memory in GiB per rank, time in s per iteration):")
    ep_head = ("  EP", "  ep_comm") if moe is not None else ("", "")
    print("  TP  CP  PP  DP" + ep_head[0] + "  mbs    m  recompute  SP  distopt |  params   grads   "
          "optim    acts   total |  iter_s  bubble  tp_comm  cp_comm  dp_comm" + ep_head[1]
          + "  tokens/s/GPU")
    for r in ranked[:args.top]:
        L, m = r.layout, r.memory
        opt = m.optimizer_distributed if L.use_distributed_optimizer else m.optimizer
        ep_cols = (f"{L.ep:4d}", f"{r.ep_comm_s:9.3f}") if moe is not None else ("", "")
        print(f"{L.tp:4d}{L.cp:4d}{L.pp:4d}{L.dp:4d}{ep_cols[0]}{L.micro_batch_size:5d}{L.num_microbatches:5d}"
              f"  {L.recompute:>9}  {'y' if L.sequence_parallel else 'n':>2}"
              f"  {'y' if L.use_distributed_optimizer else 'n':>7} |"
              f"{_gib(m.parameters)} {_gib(m.gradients)} {_gib(opt)} {_gib(m.activations)} {_gib(m.total)} |"
              f"{r.iteration_s:8.3f}{r.bubble_s:8.3f}{r.tp_comm_s:9.3f}{r.cp_comm_s:9.3f}{r.dp_comm_s:9.3f}"
              f"{ep_cols[1]}{tokens / r.iteration_s / args.num_gpus:14.0f}")

    best = ranked[0]
    L = best.layout
    tp_config = config_for_tp(config, L.tp, vocab, args.make_vocab_size_divisible_by)
    moe_kw = dict(moe=moe, ep=L.ep, etp=L.etp)
    ep_text = f" EP={L.ep} expert-TP={L.etp}" if moe is not None else ""
    print(f"\nmemory per rank of the best layout's TP={L.tp} CP={L.cp} PP={L.pp} DP={L.dp}{ep_text} micro-batch "
          f"{L.micro_batch_size} (GiB; busiest stage, {min(L.pp, L.num_microbatches)} micro-batches in flight):")
    print(f"  parameters {_gib(best.memory.parameters)}   gradients (fp32 buffer) {_gib(best.memory.gradients)}"
          f"   optimizer {_gib(best.memory.optimizer)} plain / {_gib(best.memory.optimizer_distributed)} distributed")
    strategies = (("optim", "ZeRO-1"), ("optim_grads", "ZeRO-2"), ("optim_grads_params", "ZeRO-3"))
    for strategy, label in strategies:
        z = estimate_memory(tp_config, tp=L.tp, pp=L.pp, dp=L.dp, seq_length=args.seq_length,
                            micro_batch_size=L.micro_batch_size,
                            num_microbatches=L.num_microbatches, bf16=bf16,
                            sequence_parallel=L.sequence_parallel, recompute=L.recompute,
                            cp=L.cp, use_distributed_optimizer=True, sharding_strategy=strategy,
                            overlap_grad_reduce=True, **moe_kw)  # as the launch flags below
        print(f"  {label} (--data-parallel-sharding-strategy {strategy}): parameters "
              f"{_gib(z.parameters)}   gradients (peak) {_gib(z.gradients)}   optimizer "
              f"{_gib(z.optimizer_distributed)}   total {_gib(z.total)}")
    print("  activations:  recompute   no SP      SP")
    for recompute in RECOMPUTE_CHOICES:
        row = []
        for sp in (False, True):
            # SP needs TP > 1; a MoE layer at TP > 1 needs SP (each tensor rank routes its share)
            if (sp and L.tp == 1) or (not sp and L.tp > 1 and moe is not None):
                row.append("      -")
                continue
            row.append(_gib(estimate_memory(tp_config, tp=L.tp, pp=L.pp, dp=L.dp, seq_length=args.seq_length,
                                            micro_batch_size=L.micro_batch_size,
                                            num_microbatches=L.num_microbatches, bf16=bf16,
                                            sequence_parallel=sp, recompute=recompute,
                                            cp=L.cp, **moe_kw).activations))
        label = {"selective": "selective (default)", "full": "full (uniform, 1)"}.get(recompute, recompute)
        print(f"  {label:>22} {row[0]} {row[1]}")
    print(f"\nestimated iteration {best.iteration_s:.3f} s = compute {best.compute_s:.3f} + bubble "
          f"{best.bubble_s:.3f} + TP {best.tp_comm_s:.3f} + CP {best.cp_comm_s:.3f} + PP "
          f"{best.pp_comm_s:.3f} + DP {best.dp_comm_s:.3f}"
          + (f" + EP all-to-all {best.ep_comm_s:.3f}" if moe is not None else ""))
    print("\nlaunch flags of the best layout:\n    " + launch_flags(config, best, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
