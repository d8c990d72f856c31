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
    from megatron.foreign_checkpoints import first_shard, identify

    tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return 1, {}
    first = first_shard(get_checkpoint_dir(load_dir, *read_metadata(tracker)))
    if first is None or identify(first) is not None:
        return 1, {}
    saved = load_torch_file(first).get("args")
    if not isinstance(saved, dict):
        return 1, {}
    return int(saved.get("expert_model_parallel_size") or 1), saved


def find_expert_shards(load_dir: str, ep: int, pp: int):
    """``(folder, {(tp_rank, pp_rank): [path of expert rank 0..EP-1]}, tp, pp)``.

    Raises:
        CheckpointError: a (tensor rank, pipeline rank, expert rank) shard missing, naming it.
    """
    folder = get_checkpoint_dir(load_dir, *read_metadata(
        os.path.join(load_dir, "latest_checkpointed_iteration.txt")))

    def path(t, p, e):
        sub = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + f"_{e:03d}"
        return os.path.join(folder, sub, "model_optim_rng.pt")

    tp = 0
    while os.path.isfile(path(tp, 0, 0)):
        tp += 1
    shards: Dict[Tuple[int, int], List[str]] = {}
    for t in range(max(tp, 1)):
        for p in range(pp):
            shards[(t, p)] = [path(t, p, e) for e in range(ep)]
            missing = [x for x in shards[(t, p)] if not os.path.isfile(x)]
            if missing:
                raise CheckpointError(f"{folder} is incomplete at --expert-model-parallel-size "
                                      f"{ep}: no {os.path.relpath(missing[0], folder)} (tensor "
                                      f"rank {t}, pipeline rank {p})")
    return folder, shards, tp, pp


def read_joined(paths: List[str], key: str) -> dict:
    """The model state ``key`` of one (tensor rank, pipeline rank) with all its experts, from
    the shards of expert-parallel ranks 0..EP-1 (``paths``)."""
    where = f"{os.path.dirname(os.path.dirname(paths[0]))}: "
    return moe_layout.join_expert_shards([load_torch_file(p)[key] for p in paths], where)
