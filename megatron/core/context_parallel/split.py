"""The load-balanced causal split of a sequence over the context-parallel group.

The sequence of ``s`` tokens is cut into ``2 * CP`` equal chunks of ``c = s / (2 CP)`` tokens;
context-parallel rank ``i`` holds chunks ``i`` and ``2 CP - 1 - i``, in that order (Megatron-Core's
``get_batch_on_this_cp_rank``; Liu et al. 2023, "Ring Attention", and the zig-zag split of
TransformerEngine). Under causal attention a query at position ``t`` reads ``t + 1`` keys, so an
early chunk is cheap and a late one dear: pairing chunk ``i`` with its mirror ``2 CP - 1 - i`` gives every
rank the same attention work (chunk ``t`` costs about ``(t + 1/2) c^2`` query-key pairs; a pair
sums to ``2 CP c^2``) and the same number of tokens.

Worked example, s = 16, CP = 2 (4 chunks of 4 tokens)::

    rank 0: positions  0  1  2  3 | 12 13 14 15
    rank 1: positions  4  5  6  7 |  8  9 10 11

Everything that runs token by token (embedding, norms, MLP, output layer, loss) is unchanged on
the local ``2c`` tokens; RoPE needs each token's true position (:func:`context_parallel_positions`);
only attention communicates (:mod:`megatron.core.context_parallel.attention`).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch


def check_context_parallel_seq_length(seq_length: int, context_parallel_size: int,
                                      tensor_model_parallel_size: int = 1,
                                      sequence_parallel: bool = False) -> None:
    """Refuse a sequence length the split cannot cut evenly.

    Raises:
        ValueError: ``seq_length`` not divisible by ``2 * CP`` (times TP with sequence
            parallelism, which splits each rank's ``s / CP`` tokens again over TP), naming the
            flags and the nearest valid lengths.
    """
    cp, tp = context_parallel_size, tensor_model_parallel_size
    if cp <= 1:
        return
    unit = 2 * cp * (tp if sequence_parallel and tp > 1 else 1)
    if seq_length % unit == 0:
        return
    why = (f"2 x --context-parallel-size ({cp})" if unit == 2 * cp else
           f"2 x --context-parallel-size ({cp}) x --tensor-model-parallel-size ({tp}) under "
           f"--sequence-parallel")
    lower, upper = seq_length // unit * unit, (seq_length // unit + 1) * unit
    nearest = f"{lower} or {upper}" if lower else f"{upper}"
    raise ValueError(f"--seq-length ({seq_length}) must be divisible by {why} = {unit} for the "
                     f"load-balanced context-parallel split; use e.g. {nearest}")


def context_parallel_indices(seq_length: int, cp_size: int, cp_rank: int,
                             device=None) -> torch.Tensor:
    """Positions held by ``cp_rank``: chunks ``cp_rank`` and ``2 cp_size - 1 - cp_rank``.

    Returns:
        int64 ``[seq_length / cp_size]``, increasing (chunk ``cp_rank`` first).

    Raises:
        ValueError: ``seq_length`` not divisible by ``2 * cp_size`` or a rank out of range.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} outside 0..{cp_size - 1}")
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    check_context_parallel_seq_length(seq_length, cp_size)
    c = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    mirror = 2 * cp_size - 1 - cp_rank
    second = torch.arange(mirror * c, (mirror + 1) * c, device=device)
    return torch.cat([first, second])


def context_parallel_positions(seq_length: int, micro_batch_size: int, cp_size: int,
                               cp_rank: int, device=None) -> torch.Tensor:
    """Default RoPE positions of this rank's tokens (no ``--reset-position-ids``): ``[b, s/CP]``
    int64, each token's position in the whole sequence."""
    idx = context_parallel_indices(seq_length, cp_size, cp_rank, device)
    return idx.unsqueeze(0).expand(micro_batch_size, idx.numel())


def split_for_context_parallel(tensor: Optional[torch.Tensor], cp_size: int, cp_rank: int,
                               seq_dim: int = 1) -> Optional[torch.Tensor]:
    """This rank's share of ``tensor`` along ``seq_dim`` (chunks ``i`` and ``2 CP - 1 - i``).

    Args:
        tensor: any tensor with the full sequence on ``seq_dim`` (``[b, s]`` tokens, labels,
            loss mask and position ids), or None (returned as is).

    Returns:
        A new contiguous tensor with ``s / CP`` on ``seq_dim`` (the input itself at CP = 1).
    """
    if tensor is None or cp_size == 1:
        return tensor
    idx = context_parallel_indices(tensor.shape[seq_dim], cp_size, cp_rank, tensor.device)
    return tensor.index_select(seq_dim, idx)


def get_batch_on_this_cp_rank(batch: Dict[str, Optional[torch.Tensor]], cp_size: int,
                              cp_rank: int) -> Dict[str, Optional[torch.Tensor]]:
    """Megatron-Core's ``get_batch_on_this_cp_rank`` with the group's size and rank given:
    every ``[b, s]`` entry (tokens, labels, loss_mask, position_ids) split along the sequence;
    an ``attention_mask`` object (:class:`megatron.model.attention_mask.AttentionMask`) is
    given the split by its ``for_context_parallel(cp_size, cp_rank)`` (document ids stay those
    of the whole sequence: a rank's queries read keys of other ranks' chunks).

    Raises:
        ValueError: a dense ``[b, 1, s, s]`` tensor mask (it cannot be split), or a dense
            mask object.
    """
    if cp_size == 1:
        return dict(batch)
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask):
        raise ValueError("a dense attention mask tensor cannot be split over "
                         "--context-parallel-size; pass an AttentionMask of document ids")
    split = {key: split_for_context_parallel(value, cp_size, cp_rank, seq_dim=1)
             for key, value in batch.items() if key != "attention_mask"}
    if "attention_mask" in batch:
        split["attention_mask"] = None if mask is None else mask.for_context_parallel(cp_size,
                                                                                      cp_rank)
    return split
