"""The plain optimizer's checkpoint state in a layout-independent form, for ``--include-optimizer``.

Our ``model_optim_rng.pt`` holds the state of :func:`megatron.core.optimizer.get_megatron_optimizer`
(plain, not distributed): torch AdamW's ``state_dict()`` (``{"state": {index: {"step",
"exp_avg", "exp_avg_sq"}}, "param_groups": [...]}``), wrapped for bf16/fp16 models as
``{"optimizer": ..., "fp32_from_fp16_params": [[fp32 main param]], "grad_scaler": ...}``
(Megatron-LM's ``Float16OptimizerWithFloat16Params.state_dict``). The index of a parameter is its
position in :func:`megatron.core.optimizer.optimizer.get_param_groups`: the decayed (2+-dim)
parameters in ``named_parameters`` order, then the not-decayed (1-dim) ones; our model's state
dict holds exactly its parameters, in that order, so the names follow from the model entry.

:func:`unpack` turns one shard's optimizer into flat per-quantity state dicts keyed like the
model (``exp_avg``, ``exp_avg_sq``, ``main``: the fp32 main parameter, the model weight itself
for fp32 models), which the converters partition and re-split exactly like the weights;
:func:`pack` builds the optimizer entry of a target shard from such dicts.
"""

from __future__ import annotations

import glob
import os
from typing import Dict, List, Tuple

import torch

from megatron.checkpointing import CheckpointError, distrib_optim_filename

QUANTITIES = ("exp_avg", "exp_avg_sq", "main")


def param_groups_of(model_state: Dict[str, torch.Tensor]) -> List[List[str]]:
    """Parameter names per AdamW group, as ``get_param_groups`` orders them (empty groups
    dropped): ``[[decayed ...], [not decayed ...]]``."""
    decay = [n for n, t in model_state.items() if not (n.endswith(".bias") or t.dim() == 1)]
    no_decay = [n for n, t in model_state.items() if n.endswith(".bias") or t.dim() == 1]
    return [g for g in (decay, no_decay) if g]


def refuse_distributed(shard_path: str) -> None:
    """Raise when the shard's folder holds distributed-optimizer files (not converted yet).

    Raises:
        CheckpointError: naming the file and the ways forward.
    """
    found = glob.glob(os.path.join(os.path.dirname(shard_path), distrib_optim_filename("*")))
    if found:
        raise CheckpointError(
            f"{found[0]}: --include-optimizer converts the plain optimizer's state only, and this "
            "checkpoint was saved with --use-distributed-optimizer. Convert without "
            "--include-optimizer (then train with --finetune), or keep the layout: the distributed "
            "optimizer's shards already reload at any data-parallel size")


def unpack(ckpt: dict, path: str) -> Tuple[Dict[str, Dict[str, torch.Tensor]], dict]:
    """``({quantity: {param name: fp32 tensor}}, common)`` of one checkpoint shard.

    ``common`` holds what is the same on every shard: ``step`` (tensor), ``groups`` (each group's
    hyperparameters without ``params``), ``grad_scaler`` (or None).

    Raises:
        CheckpointError: no optimizer state (saved with --no-save-optim), a parameter without Adam
            state (saved before the first step), or groups that do not match the model.
    """
    opt = ckpt.get("optimizer")
    if not opt:
        raise CheckpointError(f"{path} holds no optimizer state (saved with --no-save-optim, or a "
                              "release checkpoint); convert without --include-optimizer")
    mixed = "fp32_from_fp16_params" in opt
    torch_sd = opt["optimizer"] if mixed else opt
    model = ckpt["model"]
    names = param_groups_of(model)
    groups = torch_sd["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g) for g in names]:
        raise CheckpointError(f"{path}: the optimizer's parameter groups "
                              f"{[len(g['params']) for g in groups]} do not match the model's "
                              f"{[len(g) for g in names]} (not one of our plain-optimizer checkpoints)")
    out = {q: {} for q in QUANTITIES}
    step = None
    for g, group in enumerate(groups):
        for j, index in enumerate(group["params"]):
            name = names[g][j]
            state = torch_sd["state"].get(index)
            if not state:
                raise CheckpointError(f"{path}: no Adam state for {name} (saved before the first "
                                      "optimizer step?); convert without --include-optimizer")
            step = state["step"] if step is None else step
            out["exp_avg"][name] = state["exp_avg"]
            out["exp_avg_sq"][name] = state["exp_avg_sq"]
            out["main"][name] = (opt["fp32_from_fp16_params"][g][j] if mixed
                                 else model[name].float())
    common = {"step": step, "groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
              "grad_scaler": opt.get("grad_scaler") if mixed else None}
    return out, common


def pack(model_state: Dict[str, torch.Tensor], quantities: Dict[str, Dict[str, torch.Tensor]],
         common: dict, mixed: bool) -> dict:
    """The ``optimizer`` entry of one target shard (the inverse of :func:`unpack`).

    Args:
        model_state: the shard's model state dict (gives the names and their order).
        quantities: ``{quantity: {name: fp32 tensor}}`` for every parameter of the shard.
        common: as returned by :func:`unpack`.
        mixed: the target trains in bf16/fp16 (fp32 main params stored separately).
    """
    names = param_groups_of(model_state)
    if len(names) != len(common["groups"]):
        raise CheckpointError(f"the target shard has {len(names)} parameter groups, the source "
                              f"optimizer {len(common['groups'])}")
    state, groups, index = {}, [], 0
    for hyper, group_names in zip(common["groups"], names):
        groups.append(dict(hyper, params=list(range(index, index + len(group_names)))))
        for name in group_names:
            state[index] = {"step": common["step"].clone(), "exp_avg": quantities["exp_avg"][name],
                            "exp_avg_sq": quantities["exp_avg_sq"][name]}
            index += 1
    torch_sd = {"state": state, "param_groups": groups}
    if not mixed:
        return torch_sd
    out = {"optimizer": torch_sd,
           "fp32_from_fp16_params": [[quantities["main"][n] for n in g] for g in names]}
    if common.get("grad_scaler") is not None:
        out["grad_scaler"] = common["grad_scaler"]
    return out
