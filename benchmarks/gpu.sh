#!/usr/bin/env bash
# One command: training-step TFLOP/s and MFU of LLaMA ~1B and ~8B shapes on one NVIDIA GPU
# (bf16, SDPA flash attention, fused AdamW, sequence 4096, micro-batch 1/2/4), beside transformers'
# LlamaForCausalLM for the 1B. Installs nothing; capped at 5 minutes. Without CUDA it runs a tiny
# dry run of the same code and says so.
#   benchmarks/gpu.sh [--peak-tflops 989] [--dry-run]
# PYTHON selects the interpreter (default: the repository's .venv if present, else python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec timeout 300 "$PYTHON" benchmarks/gpu_step.py "$@"
