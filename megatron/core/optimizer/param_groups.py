"""The optimizer's parameter groups: the one order in which every optimizer, its checkpoints and
the converters index parameters."""

from __future__ import annotations

from typing import List, Optional

import torch

from megatron.core.distributed.expert_params import is_expert_param


def get_param_groups(model_chunks: List[torch.nn.Module], weight_decay: float,
                     expert: Optional[bool] = None) -> List[dict]:
    """Two AdamW groups: decayed (2+-dim weights) and not decayed (1-dim params and biases).

    Each group carries Megatron's ``wd_mult`` / ``lr_mult`` keys, which the scheduler multiplies in.
    A parameter shared between chunks appears once. ``expert``: None for every parameter, True
    or False for the expert (:func:`~megatron.core.distributed.expert_params.is_expert_param`)
    or the dense ones only (the parts of a chained optimizer).
    """
    decay, no_decay, seen = [], [], set()
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            if expert is not None and is_expert_param(p) != expert:
                continue
            seen.add(id(p))
            (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "wd_mult": 1.0, "lr_mult": 1.0, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0, "weight_decay": 0.0})
    return groups

