"""The shard folders of one of our legacy MoE checkpoints saved at expert-parallel size EP > 1.

Megatron-LM's naming: tensor rank TT, pipeline rank PPP, expert-parallel rank EEE give
``mp_rank_TT_PPP_EEE`` (PP > 1) or ``mp_rank_TT_EEE`` (PP = 1; ``mp_rank_TT_XXX`` alone is
ambiguous, so PP and EP come from the recorded ``args``). Expert-parallel rank e holds experts
``e E/EP .. (e+1) E/EP - 1`` in ``mlp.experts.weight1/2`` and the same copy of every other
tensor (:func:`tools.checkpoint.moe_layout.join_expert_shards` puts them back together).
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

from megatron.checkpointing import CheckpointError, get_checkpoint_dir, read_metadata
from tools.checkpoint import moe_layout
from tools.checkpoint.layout import load_torch_file


def saved_expert_parallel_size(load_dir: str) -> Tuple[int, dict]:
    """``(EP, args)`` of the legacy checkpoint named by ``load_dir``'s tracker, from its first
    shard's recorded ``args`` (``expert_model_parallel_size``; 1 when absent). Returns ``(1,
    {})`` for a folder without our shards (another system's, torch_dist): the callers' own
    checks name what is wrong there."""
    from megatron.checkpointing.foreign import first_shard, identify

    tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return 1, {}
    first = first_shard(get_checkpoint_dir(load_dir, *read_metadata(tracker)))
    if first is None or identify(first) is not None:
        return 1, {}
    saved = moe_layout.shard_args(load_torch_file(first))
    if not isinstance(saved, dict):
        return 1, {}
    return int(saved.get("expert_model_parallel_size") or 1), saved


def find_expert_shards(load_dir: str, ep: int, pp: int, tp: int, expert_tp: int = 1):
    """``(folder, {(tp_rank, pp_rank): [(path, same tensor rank) per expert rank 0..EP-1]}, tp,
    pp)``.

    A training run writes one folder per (tensor rank, expert rank) pair its ranks hold: at
    expert-TP 1 the expert-parallel group runs across tensor ranks, so at TP 2 x EP 2 only
    ``mp_rank_00_000`` and ``mp_rank_01_001`` may exist. The experts are whole on every tensor
    rank, so expert rank e's experts are read from its folder of the lowest tensor rank when
    tensor rank t has none; the dense tensors always come from tensor rank t's own folder. At
    ``expert_tp`` = TP > 1 each tensor rank's folder holds its own slice of the experts, so
    every (tensor rank, expert rank) folder must exist (the training code writes them all).

    Raises:
        CheckpointError: a (tensor rank, pipeline rank) or (pipeline rank, expert rank) without
            any shard, or at expert-TP > 1 a (tensor rank, expert rank) folder missing, naming it.
    """
    folder = get_checkpoint_dir(load_dir, *read_metadata(
        os.path.join(load_dir, "latest_checkpointed_iteration.txt")))

    def path(t, p, e):
        sub = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + f"_{e:03d}"
        return os.path.join(folder, sub, "model_optim_rng.pt")

    have = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)
            if os.path.isfile(path(t, p, e))}
    shards: Dict[Tuple[int, int], List[Tuple[str, bool]]] = {}
    for p in range(pp):
        for e in range(ep):
            if not any((t, p, e) in have for t in range(tp)):
                raise CheckpointError(f"{folder} is incomplete at --expert-model-parallel-size "
                                      f"{ep}: no {os.path.relpath(path(0, p, e), folder)} (nor "
                                      f"another tensor rank's shard of expert rank {e}, "
                                      f"pipeline rank {p})")
        for t in range(tp):
            if not any((t, p, e) in have for e in range(ep)):
                raise CheckpointError(f"{folder} is incomplete: no shard of tensor rank {t}, "
                                      f"pipeline rank {p} (mp_rank_{t:02d}*)")
            lacking = [e for e in range(ep) if (t, p, e) not in have]
            if expert_tp > 1 and lacking:
                raise CheckpointError(
                    f"{folder} is incomplete at --expert-tensor-parallel-size {expert_tp}: no "
                    f"{os.path.relpath(path(t, p, lacking[0]), folder)} (each tensor rank's "
                    "folder holds its own slice of the experts)")
            shards[(t, p)] = [(path(t, p, e), True) if (t, p, e) in have else
                              (path(min(u for u in range(tp) if (u, p, e) in have), p, e), False)
                              for e in range(ep)]
    return folder, shards, tp, pp


def own_shard(entries) -> str:
    """The first shard of :func:`find_expert_shards`' entry that belongs to its tensor rank."""
    return next(path for path, own in entries if own)


def read_joined(entries, key: str) -> dict:
    """The model state ``key`` of one (tensor rank, pipeline rank) with all its experts, from
    :func:`find_expert_shards`' ``entries``."""
    where = f"{os.path.dirname(os.path.dirname(own_shard(entries)))}: "
    return moe_layout.join_expert_shards([load_torch_file(path)[key] for path, _ in entries], where,
                                         own=[own for _, own in entries])
