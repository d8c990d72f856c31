"""Layout-independent weight initialisation, drawn per block, and the per-rank layout of fused
weights.

Every weight *block* (a logical weight: ``self_attention.query``, ``.key``, ``.value``,
``self_attention.dense``, ``mlp.gate``, ``mlp.up``, ``mlp.dense_4h_to_h``, the word embedding,
the output layer; for a mixture of experts, each expert's weight) is drawn from its own CPU
generator seeded by a hash of ``(seed, global layer number, block name[, expert index])``
(:func:`block_generator`). No block's values depend on another block's draws, on the
default generator, on TP, PP or which stage or rank builds it: a rank may build only the
blocks it holds (an expert-parallel rank only its experts) and still get the weights every
other layout gets. Fused weights draw their logical blocks each from its own generator and then
reorder them into the per-tensor-parallel-rank layout, so the TP=2 model equals the TP=1 model
split.

Fused layout (Megatron-LLaMA's, extended to query groups): a fused weight with logical blocks
``B_0, ..., B_{k-1}`` (rows) is stored, for tensor-parallel size T, as::

    [B_0 part 0; B_1 part 0; ...; B_{k-1} part 0;  B_0 part 1; ...;  ...; B_{k-1} part T-1]

where ``B_j part r`` is the r-th of T equal row chunks of ``B_j``. ColumnParallelLinear then keeps
the r-th of T equal chunks of the whole, i.e. ``[B_0 part r; ...; B_{k-1} part r]`` on rank r.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch


def derive_seed(seed: int, layer_number: int, name: str, expert: Optional[int] = None) -> int:
    """A 63-bit seed from ``(seed, layer_number, name[, expert])`` (SHA-256), stable across
    runs and platforms."""
    key = f"{seed}/{layer_number}/{name}" + ("" if expert is None else f"/expert{expert}")
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def block_generator(seed: int, layer_number: int, name: str,
                    expert: Optional[int] = None) -> torch.Generator:
    """A fresh CPU generator for one block (the default generator is not touched)."""
    return torch.Generator().manual_seed(derive_seed(seed, layer_number, name, expert))


def normal_block_init(std: float, seed: int, layer_number: int, name: str,
                      expert: Optional[int] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """An ``init_method`` drawing ``N(0, std)`` from the block's own generator (CPU tensors; a
    meta tensor is left as it is)."""
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta:
            return tensor
        gen = block_generator(seed, layer_number, name, expert)
        with torch.no_grad():
            return tensor.normal_(mean=0.0, std=std, generator=gen)
    return init_


def is_meta_device(device) -> bool:
    """True for the meta device (a build that allocates and draws nothing); False for None."""
    return device is not None and torch.device(device).type == "meta"


def init_block(shape: Sequence[int], std: float, seed: int, layer_number: int, name: str,
               expert: Optional[int] = None, dtype: torch.dtype = torch.float32,
               device=None) -> torch.Tensor:
    """One block ``N(0, std)`` of ``shape`` drawn alone, fp32 then cast to ``dtype``: what a
    rank that holds only this block (one expert) builds. On the meta ``device`` nothing is
    drawn (a meta tensor); otherwise the block is drawn on the CPU."""
    master = torch.empty(tuple(shape), dtype=torch.float32,
                         device="meta" if is_meta_device(device) else "cpu")
    return normal_block_init(std, seed, layer_number, name, expert)(master).to(dtype)


def scaled_std(std: float, num_layers: int) -> float:
    """``std / sqrt(2 * num_layers)`` for output projections (Megatron's
    ``scaled_init_method_normal``; GPT-2 paper, section 2.3)."""
    return std / math.sqrt(2.0 * num_layers)


def init_vocab_rows(init_method: Callable[[torch.Tensor], torch.Tensor],
                    vocab_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``init_method`` on the first ``vocab_size`` rows of a vocabulary weight ``[v_padded, h]``
    (the master weight, before it is partitioned), zeros on the padding rows after them.

    The real rows are the draws of a ``[vocab_size, h]`` tensor from the seeded generator, so they
    do not depend on how many padding rows ``--make-vocab-size-divisible-by`` x TP adds; the
    padding rows start at zero and, excluded from the loss, stay there.
    """
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        init_method(tensor[:vocab_size])
        tensor[vocab_size:].zero_()
        return tensor
    return init_


def to_fused_layout(blocks: Sequence[torch.Tensor], tensor_model_parallel_size: int) -> torch.Tensor:
    """Concatenate logical blocks ``[rows_j, ...]`` into the per-rank fused layout (module doc).

    Works for weights ``[rows, in]`` and biases ``[rows]``.

    Raises:
        ValueError: if a block's rows are not divisible by the tensor-parallel size.
    """
    tp = tensor_model_parallel_size
    for b in blocks:
        if b.shape[0] % tp:
            raise ValueError(f"fused block of {b.shape[0]} rows cannot be split over "
                             f"tensor-parallel size {tp}")
    chunks = [b.chunk(tp, dim=0) for b in blocks]
    return torch.cat([c[r] for r in range(tp) for c in chunks], dim=0)


def from_fused_layout(fused: torch.Tensor, block_rows: Sequence[int],
                      tensor_model_parallel_size: int) -> List[torch.Tensor]:
    """Inverse of :func:`to_fused_layout`: the logical blocks of a full (all ranks) fused tensor.

    Args:
        fused: ``[sum(block_rows), ...]`` in the per-rank fused layout for TP =
            ``tensor_model_parallel_size`` (the rank partitions concatenated in rank order).
        block_rows: rows of each logical block, e.g. ``[nh*d, ng*d, ng*d]`` or ``[ffn, ffn]``.
    """
    tp = tensor_model_parallel_size
    per_rank = [r // tp for r in block_rows]
    ranks = [part.split(per_rank, dim=0) for part in fused.chunk(tp, dim=0)]
    return [torch.cat([ranks[r][j] for r in range(tp)], dim=0) for j in range(len(block_rows))]


def fused_init_method(blocks: Sequence[Tuple[int, Callable[[torch.Tensor], torch.Tensor]]],
                      tensor_model_parallel_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An ``init_method`` for a fused master weight ``[sum(rows), in]``: draws each logical
    block ``(rows, init_method)`` with its own init method (its own generator), then writes them
    in the per-rank fused layout."""
    def init_(master: torch.Tensor) -> torch.Tensor:
        if master.is_meta:
            return master
        parts = []
        for rows, init_method in blocks:
            block = torch.empty(rows, *master.shape[1:], dtype=master.dtype, device=master.device)
            parts.append(init_method(block))
        with torch.no_grad():
            master.copy_(to_fused_layout(parts, tensor_model_parallel_size))
        return master
    return init_
