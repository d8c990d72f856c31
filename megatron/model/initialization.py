"""Layout-independent weight initialisation and the per-rank layout of fused weights.

Every parameterised submodule is initialised from a CPU generator seeded by ``(seed, global layer
number, submodule name)``, and fused weights draw their *logical* blocks (Q, K, V; gate, up) before
reordering them into the per-tensor-parallel-rank layout. So the weights do not depend on TP, PP
or which pipeline stage builds a layer: the TP=2 model equals the TP=1 model split.

Fused layout (Megatron-LLaMA's, extended to query groups): a fused weight with logical blocks
``B_0, ..., B_{k-1}`` (rows) is stored, for tensor-parallel size T, as::

    [B_0 part 0; B_1 part 0; ...; B_{k-1} part 0;  B_0 part 1; ...;  ...; B_{k-1} part T-1]

where ``B_j part r`` is the r-th of T equal row chunks of ``B_j``. ColumnParallelLinear then keeps
the r-th of T equal chunks of the whole, i.e. ``[B_0 part r; ...; B_{k-1} part r]`` on rank r.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Callable, List, Sequence

import torch


def derive_seed(seed: int, layer_number: int, name: str) -> int:
    """A 63-bit seed from ``(seed, layer_number, name)``, stable across runs and platforms."""
    digest = hashlib.sha256(f"{seed}/{layer_number}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def init_seed(seed: int, layer_number: int, name: str):
    """Within the block the default CPU generator is seeded from ``(seed, layer_number, name)``;
    the caller's CPU RNG state is restored afterwards (CUDA generators are not touched)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(derive_seed(seed, layer_number, name))
        yield


def init_method_normal(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``N(0, std)`` init (Megatron's ``init_method_normal``)."""
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)
    return init_


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


def scaled_init_method_normal(std: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``N(0, std / sqrt(2 * num_layers))`` for output projections (Megatron's
    ``scaled_init_method_normal``; GPT-2 paper, section 2.3)."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


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


def fused_init_method(init_method: Callable[[torch.Tensor], torch.Tensor], block_rows: Sequence[int],
                      tensor_model_parallel_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An ``init_method`` for a fused master weight ``[sum(block_rows), in]``: draws each logical
    block in order with ``init_method``, then writes them in the per-rank fused layout."""
    def init_(master: torch.Tensor) -> torch.Tensor:
        blocks = []
        for rows in block_rows:
            block = torch.empty(rows, *master.shape[1:], dtype=master.dtype, device=master.device)
            blocks.append(init_method(block))
        with torch.no_grad():
            master.copy_(to_fused_layout(blocks, tensor_model_parallel_size))
        return master
    return init_
