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


def _subsets(model: Dict[str, torch.Tensor], chained: bool) -> List[Dict[str, torch.Tensor]]:
    """The model entries of each optimizer part: all (one optimizer), or the dense then the
    expert parameters (``chained``: a model with experts, Megatron-Core's ``ChainedOptimizer``;
    the expert part exists even when this stage holds no experts)."""
    if not chained:
        return [model]
    from tools.checkpoint.moe_layout import is_expert_key
    dense = {n: t for n, t in model.items() if not is_expert_key(n)}
    return [dense, {n: t for n, t in model.items() if is_expert_key(n)}]


def unpack(ckpt: dict, path: str) -> Tuple[Dict[str, Dict[str, torch.Tensor]], dict]:
    """``({quantity: {param name: fp32 tensor}}, common)`` of one checkpoint shard.

    A model with experts saves a chained optimizer (``{"chained_optimizers": [dense part,
    expert part]}``, :class:`megatron.core.optimizer.chained_optimizer.ChainedOptimizer`): each
    part's state is unpacked over its own parameters (the experts' ``mlp.experts.weight1/2``,
    the dense ones), into the same flat dicts.

    ``common`` holds what is the same on every shard: ``chained`` and ``parts``, each part's
    ``step`` (tensor), ``groups`` (each group's hyperparameters without ``params``),
    ``grad_scaler`` (or None); ``mixed``: whether it trained in bf16/fp16.

    Raises:
        CheckpointError: no optimizer state (saved with --no-save-optim), a parameter without Adam
            state (saved before the first step), or groups or parts that do not match the model.
    """
    opt = ckpt.get("optimizer")
    if not opt:
        raise CheckpointError(f"{path} holds no optimizer state (saved with --no-save-optim, or a "
                              "release checkpoint); convert without --include-optimizer")
    chained = "chained_optimizers" in opt
    saved_parts = opt["chained_optimizers"] if chained else [opt]
    subsets = _subsets(ckpt["model"], chained)
    if len(saved_parts) != len(subsets):
        raise CheckpointError(f"{path}: the optimizer holds {len(saved_parts)} parts, a model "
                              f"with experts {len(subsets)} (dense and expert)")
    out = {q: {} for q in QUANTITIES}
    parts = [_unpack_part(part, model, path, out) for part, model in zip(saved_parts, subsets)]
    return out, {"chained": chained, "parts": parts,
                 "mixed": "fp32_from_fp16_params" in saved_parts[0]}


def _unpack_part(opt: dict, model: Dict[str, torch.Tensor], path: str, out: dict) -> dict:
    """One optimizer's state over the parameters ``model`` into ``out``; returns its common
    part (see :func:`unpack`)."""
    mixed = "fp32_from_fp16_params" in opt
    torch_sd = opt["optimizer"] if mixed else opt
    names = param_groups_of(model)
    groups = [g for g in torch_sd["param_groups"] if g["params"] or names]
    if [len(g["params"]) for g in groups] != [len(g) for g in names]:
        raise CheckpointError(f"{path}: the optimizer's parameter groups "
                              f"{[len(g['params']) for g in groups]} do not match the model's "
                              f"{[len(g) for g in names]} (not one of our plain-optimizer checkpoints)")
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
    return {"step": step, "groups": [{k: v for k, v in g.items() if k != "params"}
                                     for g in torch_sd["param_groups"]],
            "grad_scaler": opt.get("grad_scaler") if mixed else None}


def pack(model_state: Dict[str, torch.Tensor], quantities: Dict[str, Dict[str, torch.Tensor]],
         common: dict, mixed: bool) -> dict:
    """The ``optimizer`` entry of one target shard (the inverse of :func:`unpack`; chained, one
    part per kind of parameter, when the source's was).

    Args:
        model_state: the shard's model state dict (gives the names and their order).
        quantities: ``{quantity: {name: fp32 tensor}}`` for every parameter of the shard.
        common: as returned by :func:`unpack`.
        mixed: the target trains in bf16/fp16 (fp32 main params stored separately).
    """
    subsets = _subsets(model_state, common["chained"])
    parts = [_pack_part(model, quantities, part, mixed)
             for model, part in zip(subsets, common["parts"])]
    if not common["chained"]:
        return parts[0]
    return {"chained_optimizers": parts, "distributed_optimizer": False}


def _pack_part(model_state, quantities, common: dict, mixed: bool) -> dict:
    names = param_groups_of(model_state)
    hypers = common["groups"]
    if not names:  # a part without parameters on this stage: its empty group(s) as saved
        names = [[] for _ in hypers]
    if len(names) != len(hypers):
        raise CheckpointError(f"the target shard has {len(names)} parameter groups, the source "
                              f"optimizer {len(hypers)}")
    state, groups, index = {}, [], 0
    for hyper, group_names in zip(hypers, names):
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
