"""The "GEMM-only ceiling" of a training step: exactly its matrix products, nothing else.

A LLaMA training step at TP = PP = 1 multiplies, per linear layer ``y = x W^T`` with x ``[N, in]``
(N = batch x sequence tokens): forward ``x W^T``, input gradient ``dy W`` and weight gradient
``dy^T x``; per layer and per attention head (batch b x heads), forward ``Q K^T`` and ``P V``
and backward ``dO V^T``, ``P^T dO``, ``dS K`` and ``dS^T Q``. Timing these products back to back
on preallocated operands gives the fastest a step could possibly be on this machine; the ratio
``ceiling time / step time`` says how much of a step is spent outside them (element-wise passes,
copies, the optimizer, the framework).
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import torch

from megatron.config import ModelConfig


def gemm_shapes(config: ModelConfig, batch: int, seq: int) -> List[Tuple[int, int, int, int]]:
    """``(batch_count, m, k, n)`` of every matrix product of one step (``[m, k] @ [k, n]``)."""
    c, tokens = config, batch * seq
    nh, ng, d, h, f = (c.num_attention_heads, c.num_query_groups, c.kv_channels, c.hidden_size,
                       c.ffn_hidden_size)
    linears = [(h, (nh + 2 * ng) * d), (nh * d, h), (h, 2 * f), (f, h)] * c.num_layers
    linears.append((h, c.padded_vocab_size))
    shapes = []
    for fan_in, fan_out in linears:
        shapes += [(1, tokens, fan_in, fan_out),   # forward
                   (1, tokens, fan_out, fan_in),   # input gradient
                   (1, fan_out, tokens, fan_in)]   # weight gradient
    heads = batch * nh
    attention = [(heads, seq, d, seq), (heads, seq, seq, d),                          # forward
                 (heads, seq, d, seq), (heads, seq, seq, d), (heads, seq, seq, d),     # backward
                 (heads, seq, seq, d)]
    return shapes + attention * c.num_layers


def gemm_ceiling_step(config: ModelConfig, batch: int, seq: int,
                      dtype: torch.dtype = torch.float32) -> Callable[[], None]:
    """A function running every matrix product of one step once (operands allocated here)."""
    operands = {}
    for shape in set(gemm_shapes(config, batch, seq)):
        count, m, k, n = shape
        a, b = torch.randn(count, m, k).to(dtype), torch.randn(count, k, n).to(dtype)
        operands[shape] = (a, b, torch.empty(count, m, n, dtype=dtype))
    plan = [operands[s] for s in gemm_shapes(config, batch, seq)]

    def step():
        for a, b, out in plan:
            if a.size(0) == 1:
                torch.mm(a[0], b[0], out=out[0])
            else:
                torch.bmm(a, b, out=out)
    return step
