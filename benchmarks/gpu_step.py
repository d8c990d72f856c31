"""Single-GPU training-step throughput and MFU of our LLaMA (``benchmarks/gpu.sh`` runs this).

Our real code path: ``LlamaModel`` in bf16 (SDPA attention, which picks flash on CUDA), the DDP
wrapper's fp32 gradient buffer, ``get_megatron_optimizer`` (fused AdamW on CUDA, fp32 main params),
in a ``torch.distributed`` world of one process (NCCL on CUDA, gloo on CPU). Shapes: LLaMA-3.2-1B
(16 layers, hidden 2048) and Llama-3-8B (hidden 4096) with fewer layers so that weights, Adam
state and activations fit one GPU; sequence 4096, micro-batch 1, 2, 4. Beside the 1B, the same
step of transformers' ``LlamaForCausalLM`` (bf16, SDPA, fused AdamW, same batch).

MFU = Megatron's model FLOPs of the step (:func:`megatron.model.flops.num_floating_point_operations`)
/ step time / the GPU's dense bf16 peak (table below, or ``--peak-tflops``). On a machine without
CUDA it runs a tiny dry run of the same code and says so; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config import ModelConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.model.flops import num_floating_point_operations  # noqa: E402

# Dense bf16 peak TFLOP/s (no sparsity) by substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0),
                    ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0),
                    ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0), ("RTX 4090", 165.0)]

LLAMA_1B = ModelConfig(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                       num_query_groups=8, padded_vocab_size=128256, max_position_embeddings=4096,
                       rotary_base=500000.0)
LLAMA_8B_SHORT = ModelConfig(num_layers=8, hidden_size=4096, ffn_hidden_size=14336,
                             num_attention_heads=32, num_query_groups=8, padded_vocab_size=128256,
                             max_position_embeddings=4096, rotary_base=500000.0)
DRY_RUN = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                      num_query_groups=2, padded_vocab_size=256, max_position_embeddings=64)


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The dense bf16 peak of ``device`` in TFLOP/s: ``override``, the table, or None."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def init_world(device: torch.device) -> None:
    """A torch.distributed world of one (NCCL on CUDA, gloo on CPU) and TP = PP = 1 groups."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _batch(config, mbs, seq, device):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.padded_vocab_size, (mbs, seq + 1), generator=g).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _time(step, device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - start) / steps


def ours_step_time(config: ModelConfig, mbs: int, seq: int, device, dtype, warmup: int, steps: int) -> float:
    """Seconds per training step of our model, DDP buffer and Megatron optimizer."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.model.llama import LlamaModel
    groups = parallel_state.get_process_groups()
    model = LlamaModel(config.replace(params_dtype=dtype), device=device, pg_collection=groups)
    ddp = DistributedDataParallel(model, data_parallel_group=groups.dp_cp.group)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-5, bf16=dtype == torch.bfloat16), [ddp],
                                 pg_collection=groups)
    tokens, labels = _batch(config, mbs, seq, device)

    def step():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        model(tokens, labels=labels).mean().backward()
        ddp.finish_grad_sync()
        opt.step()
    try:
        return _time(step, device, warmup, steps)
    finally:
        del model, ddp, opt
        _free(device)


def hf_step_time(config: ModelConfig, mbs: int, seq: int, device, dtype, warmup: int, steps: int) -> float:
    """Seconds per step of transformers' LlamaForCausalLM with the same shape, batch and AdamW."""
    import transformers
    c = config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.padded_vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_query_groups, max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rotary_base, tie_word_embeddings=False, attn_implementation="sdpa",
        torch_dtype=dtype)).to(device=device, dtype=dtype).train()
    kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, **kernel)
    tokens, labels = _batch(config, mbs, seq, device)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = hf(tokens).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        opt.step()
    try:
        return _time(step, device, warmup, steps)
    finally:
        del hf, opt
        _free(device)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(quick: bool = False, peak: float | None = None, device: torch.device | None = None) -> list:
    """Measure every configuration; rows of ``{"benchmark", "case", "tokens/s", "TFLOP/s", "MFU", ...}``.

    ``quick`` (or no CUDA) runs the tiny dry run on the same code path.
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dry = quick or device.type != "cuda"
    init_world(device)
    peak = peak_tflops(device, peak)
    if dry:
        plans = [("dry-run tiny", DRY_RUN, (1, 2), 64, True)]
        dtype, warmup, steps = torch.float32 if device.type == "cpu" else torch.bfloat16, 1, 2
    else:
        plans = [("llama-1B", LLAMA_1B, (1, 2, 4), 4096, True),
                 (f"llama-8B shape, {LLAMA_8B_SHORT.num_layers} layers", LLAMA_8B_SHORT, (1, 2, 4), 4096, False)]
        dtype, warmup, steps = torch.bfloat16, 2, 5
    rows = []
    for name, config, mbs_list, seq, with_hf in plans:
        for mbs in mbs_list:
            flops = num_floating_point_operations(config, mbs, seq)
            ours = ours_step_time(config, mbs, seq, device, dtype, warmup, steps)
            row = {"benchmark": "gpu_step", "case": f"{name} mbs={mbs}", "device": str(device),
                   "dry_run": dry, "seconds": ours, "tokens/s": mbs * seq / ours,
                   "TFLOP/s": flops / ours / 1e12, "MFU": flops / ours / 1e12 / peak if peak else None}
            if with_hf:
                ref = hf_step_time(config, mbs, seq, device, dtype, warmup, steps)
                row.update({"reference tokens/s": mbs * seq / ref, "ratio": ref / ours,
                            "reference MFU": flops / ref / 1e12 / peak if peak else None})
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    mfu = f"{row['MFU']:.1%}" if row.get("MFU") is not None else "n/a"
    s = (f"{row['case']:<34} {row['tokens/s']:>10.0f} tokens/s  {row['TFLOP/s']:8.2f} TFLOP/s  MFU {mfu:>6}")
    if "ratio" in row:
        s += f"  | transformers {row['reference tokens/s']:>10.0f} tokens/s  ours/transformers {row['ratio']:.3f}"
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak per GPU in TFLOP/s (default: by device name)")
    p.add_argument("--dry-run", action="store_true", help="the tiny configuration even on a GPU")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}; peak "
              f"{peak_tflops(device, args.peak_tflops) or 'unknown (give --peak-tflops)'} TFLOP/s bf16 dense")
    else:
        print("no CUDA device: DRY RUN of the same code path on CPU with a tiny model (fp32); "
              "these numbers are not GPU performance")
    try:
        run(quick=args.dry_run, peak=args.peak_tflops, device=device)
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
