"""Training-step throughput of our LLaMA model beside transformers' LlamaForCausalLM (one CPU process).

For hidden 256 and 1024, both models get the same configuration, the same weights (copied from
ours), the same batch, the same loss (mean token cross entropy) and AdamW (ours fused, as our
training runs it; transformers with torch's default kernel, as HF's Trainer builds it), without
clipping unless ``--clip-grad`` is given (then ours clips as ``--clip-grad`` does, transformers
with ``torch.nn.utils.clip_grad_norm_``, as HF's Trainer's ``max_grad_norm`` does).
Ours runs its real training path: the DDP gradient buffer and the Megatron optimizer wrapper (fp32;
with ``--bf16`` bf16 parameters and fp32 main parameters); transformers runs fp32, and bf16 under
``torch.autocast`` beside it. The "GEMM-only ceiling" times exactly the matrix products of one
training step of the configuration (every linear layer's forward, input-gradient and
weight-gradient products, and the attention's six batched products per layer) with preallocated
operands: a step can be no faster. Rounds are interleaved (the order rotates per round) because
these machines drift by +-10%; every result is the median over rounds of a paired ratio, printed
beside MFU against the measured matmul peak (fp32 or bf16).

Usage: python benchmarks/train_step.py [--rounds 7] [--steps 2] [--threads N] [--only 256 1024]
       [--clip-grad 1.0]
``run(quick)`` returns the rows for ``benchmarks/run_all.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config import ModelConfig  # noqa: E402
from megatron.model.flops import num_floating_point_operations  # noqa: E402
from megatron.core.transformer.initialization import from_fused_layout  # noqa: E402
from megatron.model.llama import LlamaModel  # noqa: E402
from megatron.training.mfu import measure_peak_tflops  # noqa: E402
from benchmarks.gemm_ceiling import gemm_ceiling_step  # noqa: E402

# The CPU demo's model (README): 4 layers, hidden 256, 8 heads in 4 groups, ffn 688, 32k vocabulary.
CONFIG = ModelConfig(num_layers=4, hidden_size=256, ffn_hidden_size=688, num_attention_heads=8,
                     num_query_groups=4, padded_vocab_size=32000, max_position_embeddings=256,
                     norm_epsilon=1e-5)
# The same shape at hidden 1024 (LLaMA's ffn rule: 8/3 h rounded up to a multiple of 256).
CONFIG_1024 = CONFIG.replace(hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16,
                             num_query_groups=8, kv_channels=64)
CONFIGS = {256: CONFIG, 1024: CONFIG_1024}
MICRO_BATCH, SEQ = 2, 256


def reference_model(ours: LlamaModel):
    """transformers' LlamaForCausalLM with our weights (HF layout: separate q/k/v, gate/up)."""
    import transformers
    c = ours.config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.padded_vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_epsilon,
        rope_theta=c.rotary_base, tie_word_embeddings=False, attn_implementation="sdpa"))
    d, nh, ng, f = c.kv_channels, c.num_attention_heads, c.num_query_groups, c.ffn_hidden_size
    sd = {"model.embed_tokens.weight": ours.word_embeddings.weight,
          "model.norm.weight": ours.final_layernorm.weight, "lm_head.weight": ours.output_layer.weight}
    for i, layer in enumerate(ours.layers):
        p, a, m = f"model.layers.{i}.", layer.self_attention, layer.mlp
        q, k, v = from_fused_layout(a.query_key_value.weight, [nh * d, ng * d, ng * d], 1)
        gate, up = from_fused_layout(m.dense_h_to_4h.weight, [f, f], 1)
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": a.dense.weight,
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": m.dense_4h_to_h.weight,
                   p + "input_layernorm.weight": layer.input_layernorm.weight,
                   p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
    hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
    return hf.train()


def _batch(config: ModelConfig):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.padded_vocab_size, (MICRO_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _init_world() -> None:
    from benchmarks.gpu_step import init_world
    init_world(torch.device("cpu"))


def ours_runner(config: ModelConfig, dtype: torch.dtype, tokens, labels, clip_grad: float = 0.0):
    """(model, step) of our training path: DDP buffer, Megatron optimizer (fp32, or bf16 params
    with fp32 main params as ``--bf16``), fused AdamW, clipping to ``clip_grad`` (0: none)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    torch.manual_seed(0)
    groups = parallel_state.get_process_groups()
    model = LlamaModel(config.replace(params_dtype=dtype), pg_collection=groups).train()
    ddp = DistributedDataParallel(model, data_parallel_group=groups.dp_cp.group)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, clip_grad=clip_grad,
                                                 bf16=dtype == torch.bfloat16), [ddp],
                                 pg_collection=groups)

    def step():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        model(tokens, labels=labels).mean().backward()
        ddp.finish_grad_sync()
        opt.step()
    return model, step


def reference_runner(ours: LlamaModel, autocast: bool, tokens, labels, clip_grad: float = 0.0):
    """transformers with our weights, torch AdamW as HF's Trainer builds it (default kernel),
    ``clip_grad_norm_`` to ``clip_grad`` when above 0; bf16 through ``torch.autocast``."""
    model = reference_model(ours)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # torch's default kernel, as a user gets

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens).logits
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        if clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        opt.step()
    return model, step


def _seconds(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def measure(hidden: int, rounds: int, steps: int, clip_grad: float = 0.0) -> list:
    """Rows for one configuration: ours / transformers / ceiling, fp32 and bf16 (paired medians)."""
    config = CONFIGS[hidden]
    tokens, labels = _batch(config)
    ours32, ours32_step = ours_runner(config, torch.float32, tokens, labels, clip_grad)
    _, ref32_step = reference_runner(ours32, False, tokens, labels, clip_grad)
    with torch.no_grad():  # same weights, same function: the comparison is like for like
        gap = (ours32(tokens, labels=labels).mean()
               - F.cross_entropy(reference_model(ours32)(tokens).logits.flatten(0, 1),
                                 labels.flatten())).abs().item()
    _, ours16_step = ours_runner(config, torch.bfloat16, tokens, labels, clip_grad)
    _, ref16_step = reference_runner(ours32, True, tokens, labels, clip_grad)
    runs = {"ours fp32": ours32_step, "transformers fp32": ref32_step,
            "ours bf16": ours16_step, "transformers bf16": ref16_step,
            "ceiling fp32": gemm_ceiling_step(config, MICRO_BATCH, SEQ, torch.float32),
            "ceiling bf16": gemm_ceiling_step(config, MICRO_BATCH, SEQ, torch.bfloat16)}
    for step in runs.values():  # warm-up: allocator, optimizer state, kernel selection
        _seconds(step, 2)
    names = list(runs)
    seconds = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds[name].append(_seconds(runs[name], steps))

    def paired(a, b):  # median over rounds of seconds[b] / seconds[a] (= throughput a / b)
        return statistics.median(y / x for x, y in zip(seconds[a], seconds[b]))

    flops = num_floating_point_operations(config, MICRO_BATCH, SEQ)
    peaks = {"fp32": measure_peak_tflops(torch.device("cpu"), torch.float32, 2048),
             "bf16": measure_peak_tflops(torch.device("cpu"), torch.bfloat16, 2048)}
    rows = []
    for precision in ("fp32", "bf16"):
        for who in ("ours", "transformers"):
            name = f"{who} {precision}"
            med = statistics.median(seconds[name])
            row = {"benchmark": "train_step", "case": f"h{hidden} {name}", "ms/step": med * 1e3,
                   "tokens/s": MICRO_BATCH * SEQ / med, "MFU": flops / med / (peaks[precision] * 1e12),
                   "of ceiling": paired(name, f"ceiling {precision}")}
            if who == "ours":
                row["ratio"] = paired(name, f"transformers {precision}")
            rows.append(row)
        rows.append({"benchmark": "train_step", "case": f"h{hidden} GEMM-only ceiling {precision}",
                     "ms/step": statistics.median(seconds[f"ceiling {precision}"]) * 1e3,
                     "TFLOP/s": peaks[precision]})
    rows[0]["note"] = f"initial loss gap vs transformers {gap:.1e}"
    return rows


def run(quick: bool = False, hiddens=(256, 1024), rounds: int = 7, steps: int = 2,
        clip_grad: float = 0.0) -> list:
    """Rows for ``benchmarks/run_all.py`` (quick: hidden 256 only, 5 rounds of one step)."""
    _init_world()
    if quick:
        hiddens, rounds, steps = (256,), 5, 1
    rows = []
    for hidden in hiddens:
        rows += measure(hidden, rounds, steps, clip_grad)
    return rows


def format_rows(rows: list) -> str:
    lines = [f"{'case':<34}{'ms/step':>10}{'tokens/s':>10}{'MFU':>8}{'of ceiling':>12}"
             f"{'vs transformers':>17}"]
    for r in rows:
        cells = [f"{r['ms/step']:10.1f}", f"{r['tokens/s']:10.0f}" if "tokens/s" in r else " " * 10,
                 f"{r['MFU']:8.1%}" if "MFU" in r else " " * 8,
                 f"{r['of ceiling']:12.1%}" if "of ceiling" in r else " " * 12,
                 f"{r['ratio']:16.3f}x" if "ratio" in r else ""]
        lines.append(f"{r['case']:<34}" + "".join(cells))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (>= 5)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per runner per round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--only", type=int, nargs="+", default=[256, 1024], choices=sorted(CONFIGS),
                        help="hidden sizes to measure")
    parser.add_argument("--clip-grad", type=float, default=0.0,
                        help="clip both sides to this global gradient norm (0: no clipping)")
    args = parser.parse_args(argv)
    if args.rounds < 5:
        parser.error("--rounds must be at least 5 (a median of paired ratios needs them)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clip_grad < 0:
        parser.error("--clip-grad must be >= 0 (0: no clipping)")
    rows = run(False, args.only, args.rounds, args.steps, args.clip_grad)
    print(f"batch {MICRO_BATCH} x {SEQ} tokens, 4 layers, vocab 32000, {torch.get_num_threads()} "
          f"threads; clip-grad {args.clip_grad}; medians of {args.rounds} interleaved rounds x {args.steps} steps; "
          "'of ceiling' and 'vs transformers' are medians of paired ratios; "
          f"{rows[0]['note']}")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
