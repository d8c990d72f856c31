"""Training-step throughput of our LLaMA model beside transformers' LlamaForCausalLM (one CPU process).

Both models get the same configuration, the same weights (copied from ours), the same batch, the
same loss (mean token cross entropy) and the same optimizer (torch AdamW). Rounds are interleaved
(ours, reference; the order alternates per round) because these machines drift by +-10%; the
result is the median over rounds of the paired ratio ``our tokens/s / reference tokens/s``, printed
beside model FLOP utilisation against the measured fp32 matmul peak of the machine.

Usage: python benchmarks/train_step.py [--rounds 7] [--steps 3] [--threads N]
Not a timed test: run it by hand and read the numbers.
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
from megatron.model.initialization import from_fused_layout  # noqa: E402
from megatron.model.llama import LlamaModel  # noqa: E402

# The CPU demo's model (README): 4 layers, hidden 256, 8 heads in 4 groups, ffn 688, 32k vocabulary.
CONFIG = ModelConfig(num_layers=4, hidden_size=256, ffn_hidden_size=688, num_attention_heads=8,
                     num_query_groups=4, padded_vocab_size=32000, max_position_embeddings=256,
                     norm_epsilon=1e-5)
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


def ours_step(model, tokens, labels):
    return model(tokens, labels=labels).mean()


def reference_step(model, tokens, labels):
    logits = model(tokens).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def time_steps(step, model, optimizer, tokens, labels, steps: int) -> float:
    """Seconds per training step (forward, backward, AdamW step)."""
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step(model, tokens, labels).backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best fp32 FLOP/s of an n x n x n matmul on this process's threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (>= 5)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per model per round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.rounds < 5:
        parser.error("--rounds must be at least 5 (a median of paired ratios needs them)")
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    ours = LlamaModel(CONFIG).train()
    reference = reference_model(ours)
    tokens = torch.randint(0, CONFIG.padded_vocab_size, (MICRO_BATCH, SEQ + 1))
    tokens, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with torch.no_grad():  # same weights, same function: the comparison is like for like
        gap = (ours_step(ours, tokens, labels) - reference_step(reference, tokens, labels)).abs().item()
    runs = {"ours": (ours_step, ours, torch.optim.AdamW(ours.parameters(), lr=1e-4)),
            "reference": (reference_step, reference, torch.optim.AdamW(reference.parameters(), lr=1e-4))}
    for step, model, opt in runs.values():  # warm-up: allocator, optimizer state
        time_steps(step, model, opt, tokens, labels, 2)

    seconds = {"ours": [], "reference": []}
    for r in range(args.rounds):
        order = ["ours", "reference"] if r % 2 == 0 else ["reference", "ours"]
        for name in order:
            seconds[name].append(time_steps(*runs[name], tokens, labels, args.steps))
    ratios = [ref / our for our, ref in zip(seconds["ours"], seconds["reference"])]

    peak = matmul_peak_flops()
    flops = num_floating_point_operations(CONFIG, MICRO_BATCH, SEQ)
    n_tokens = MICRO_BATCH * SEQ
    print(f"config: {CONFIG.num_layers} layers, hidden {CONFIG.hidden_size}, {CONFIG.num_attention_heads} "
          f"heads / {CONFIG.num_query_groups} groups, ffn {CONFIG.ffn_hidden_size}, vocab "
          f"{CONFIG.padded_vocab_size}, batch {MICRO_BATCH} x {SEQ} tokens, fp32, "
          f"{torch.get_num_threads()} threads; initial loss gap {gap:.2e}")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s; model FLOPs per step: {flops / 1e9:.2f} G")
    for name in ("ours", "reference"):
        med = statistics.median(seconds[name])
        print(f"{name:>9}: {med * 1e3:8.1f} ms/step  {n_tokens / med:8.0f} tokens/s  "
              f"MFU {flops / med / peak:6.1%}  (rounds: {', '.join(f'{s * 1e3:.0f}' for s in seconds[name])} ms)")
    print(f"median paired throughput ratio ours / transformers: {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
