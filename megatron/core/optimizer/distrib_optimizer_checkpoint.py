"""The distributed optimizer's layout-independent checkpoint form, and conversions to and from the
plain optimizer's layout.

Every DP rank saves ``distrib_optim_dp_DDD.pt`` = ``{"params": {name: {"range": [start, end],
"param", "exp_avg", "exp_avg_sq"}}, "step": int}``: for each parameter (named
``"<chunk index>.<name in the chunk>"``) the fp32 main values and Adam moments of the elements
``[start, end)`` of the flattened parameter that the rank owned; bucket padding is never saved.
The union of the files of all DP ranks covers every parameter once, whatever the DP size and the
bucket size, so a run re-cuts it into its own shards.

Expert parameters (``[E_local, ...]`` on each expert-parallel rank) are recorded on the global
expert axis: EP rank r's flattened tensor is the slice ``[r * n, (r + 1) * n)`` of the flattened
``[E, ...]`` tensor (``n`` its own element count), and its records carry ranges in that global
tensor (:func:`expert_ranges`, :func:`to_global_ranges`), so shards saved at one EP load at
another (:class:`ShardFiles`). At EP = 1 global and local ranges are the same.

The plain optimizers (:class:`~megatron.core.optimizer.optimizer.FP32Optimizer`: a torch AdamW
``state_dict``; :class:`~megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params`:
``{"optimizer": ..., "fp32_from_fp16_params": [[...]]}``, Megatron's keys) index parameters by
their position in :func:`~megatron.core.optimizer.optimizer.get_param_groups`; both directions of
conversion follow that order, so a checkpoint of either optimizer loads into the other (same model
layout: TP and PP sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch

from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file
from megatron.core.optimizer.param_groups import get_param_groups
from megatron.core.distributed.distributed_data_parallel import unwrap_chunk

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
_HALF = (torch.float16, torch.bfloat16)


def param_names(model_chunks) -> Dict[torch.nn.Parameter, str]:
    """``param -> "<chunk index>.<name>"`` (names in the unwrapped chunk; a shared param once)."""
    names = {}
    for ci, chunk in enumerate(model_chunks):
        for n, p in unwrap_chunk(chunk).named_parameters():
            names.setdefault(p, f"{ci}.{n}")
    return names


def expert_ranges(model_chunks, ep_rank: int) -> Dict[str, Tuple[int, int]]:
    """``{name: (offset, numel)}`` of this rank's expert parameters (names as
    :func:`param_names`): where its flattened ``[E_local, ...]`` tensor starts in the flattened
    global ``[E, ...]`` tensor (``ep_rank * numel``), and its element count."""
    from megatron.core.distributed.expert_params import is_expert_param

    return {name: (ep_rank * p.numel(), p.numel())
            for p, name in param_names(model_chunks).items() if is_expert_param(p)}


def to_global_ranges(state: dict, ranges: Dict[str, Tuple[int, int]],
                     expert_tensor_rank: int = 0) -> dict:
    """:meth:`DistributedOptimizer.parameter_state`'s ``state`` with the expert records'
    ranges moved onto the global expert axis and the rank's ``expert_tensor_rank`` recorded
    (in place; returned)."""
    state["expert_tensor_rank"] = expert_tensor_rank
    for name, rec in state["params"].items():
        if name in ranges:
            offset = ranges[name][0]
            rec["range"] = [rec["range"][0] + offset, rec["range"][1] + offset]
    return state


@dataclass
class ShardFiles:
    """The shard files a rank reads, when not every file holds records it may take (legacy
    checkpoints at EP > 1, whose ``mp_rank_TT[_PPP]_EEE`` folders each hold the shards of
    some DP x CP ranks).

    Attributes:
        dense: files whose non-expert records are this rank's (its tensor and pipeline rank).
        expert: files whose expert records are read (every folder of its pipeline rank: experts
            are whole on each tensor rank, sharded over expert-DP, which may span them).
        expert_ranges: :func:`expert_ranges` of this rank: expert records hold global ranges,
            cut here to this rank's slice and shifted to local ranges.
        expert_tensor_rank: this rank's expert-tensor-parallel rank: the expert records of a
            file are read only when the file's ``expert_tensor_rank`` is the same (another
            expert-TP rank holds other slices under the same names); a file without it (saved
            before it was recorded) only when it is in ``dense``. None: no check.
        expert_records: when given, ``() -> {name: [record]}``, the expert records with local
            ranges, built elsewhere (a legacy checkpoint saved at another expert-TP:
            :func:`megatron.checkpointing.legacy_experts.resliced_shard_files`).
    """

    dense: List[str]
    expert: List[str]
    expert_ranges: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    expert_tensor_rank: int | None = None
    expert_records: Callable[[], Dict[str, list]] | None = None

    def takes_experts_of(self, path: str, saved: dict) -> bool:
        if path not in self.expert:
            return False
        if self.expert_tensor_rank is None:
            return True
        if "expert_tensor_rank" not in saved:
            return path in self.dense
        return saved["expert_tensor_rank"] == self.expert_tensor_rank

    def __bool__(self) -> bool:
        return bool(self.dense or self.expert)

    def __getitem__(self, i):  # the first file, named in messages
        return (self.dense or self.expert)[i]


def _localize(rec: dict, offset: int, numel: int) -> dict | None:
    """The part of a global-range expert record inside ``[offset, offset + numel)``, with a
    local range; None if it has none."""
    s, t = rec["range"]
    lo, hi = max(s, offset), min(t, offset + numel)
    if lo >= hi:
        return None
    out = {"range": [lo - offset, hi - offset]}
    for k in STATE_KEYS:
        out[k] = rec[k].reshape(-1)[lo - s:hi - s]
    return out


def read_shards(paths) -> Tuple[Dict[str, list], int]:
    """Read the shard files of all DP ranks: ``({name: [record, ...]}, step)``. ``paths``: a
    list (every record of every file; the ranges as saved), or a :class:`ShardFiles`."""
    if not isinstance(paths, ShardFiles):
        paths = ShardFiles(list(paths), list(paths))
    ranges = paths.expert_ranges
    dense = set(paths.dense)
    pieces: Dict[str, list] = {}
    step = 0
    for path in dict.fromkeys(paths.dense + paths.expert):
        sd = load_torch_file(path, what="distributed-optimizer shard")
        step = max(step, int(sd["step"]))
        experts = paths.takes_experts_of(path, sd)
        for name, rec in sd["params"].items():
            if name in ranges:
                rec = _localize(rec, *ranges[name]) if experts else None
            elif path not in dense:
                rec = None
            if rec is not None:
                pieces.setdefault(name, []).append(rec)
    if paths.expert_records is not None:
        for name, recs in paths.expert_records().items():
            pieces.setdefault(name, []).extend(recs)
    return pieces, step


def _full_values(pieces: Dict[str, list], name: str, numel: int, source: str) -> Dict[str, torch.Tensor]:
    values = {k: torch.zeros(numel, dtype=torch.float32) for k in STATE_KEYS}
    covered = 0
    for rec in pieces.get(name, []):
        s, t = rec["range"]
        covered += t - s
        for k in STATE_KEYS:
            values[k][s:t] = rec[k].reshape(-1)
    if covered != numel:
        raise ValueError(f"{source}: parameter {name} has {covered} of its {numel} elements (a DP "
                         "rank's distrib_optim_dp_*.pt file is missing, or the model differs); "
                         "load with --no-load-optim")
    return values


def _check_groups(saved_sizes: List[int], groups: List[dict], what: str) -> None:
    sizes = [len(g["params"]) for g in groups]
    if saved_sizes != sizes:
        raise ValueError(f"{what}: parameter groups of {saved_sizes} parameters do not match the "
                         f"model's {sizes}; load with --no-load-optim or use the same model "
                         "configuration (TP and PP sizes)")


def plain_to_records(state_dict: dict, model_chunks, weight_decay: float) -> Tuple[Dict[str, list], int]:
    """Convert a plain optimizer's ``state_dict`` (saved without ``--use-distributed-optimizer``)
    to per-parameter records covering each parameter whole.

    fp32 models keep no main copy: the main values are the model's current (just loaded) weights.

    Raises:
        ValueError: if the saved parameter groups or shapes do not match ``model_chunks``.
    """
    torch_sd = state_dict["optimizer"] if "fp32_from_fp16_params" in state_dict else state_dict
    mains = state_dict.get("fp32_from_fp16_params")
    groups = get_param_groups(model_chunks, weight_decay)
    what = "optimizer checkpoint saved without --use-distributed-optimizer"
    _check_groups([len(g["params"]) for g in torch_sd["param_groups"]], groups, what)
    names = param_names(model_chunks)
    records, step = {}, 0
    for gi, (group, saved) in enumerate(zip(groups, torch_sd["param_groups"])):
        half = 0
        for p, index in zip(group["params"], saved["params"]):
            state = torch_sd["state"].get(index, {})
            main = p.detach()
            if mains is not None and p.dtype in _HALF:
                main, half = mains[gi][half], half + 1
            if main.numel() != p.numel():
                raise ValueError(f"{what}: {names[p]} has {main.numel()} elements, the model "
                                 f"{p.numel()}; load with --no-load-optim or use the same model "
                                 "configuration")
            zeros = torch.zeros(p.numel(), dtype=torch.float32)
            rec = {"range": [0, p.numel()], "param": main.detach().float().reshape(-1).cpu()}
            for k in ("exp_avg", "exp_avg_sq"):
                rec[k] = state[k].float().reshape(-1).cpu() if k in state else zeros
            if "step" in state:
                step = int(state["step"])
            records[names[p]] = [rec]
    return records, step


def shards_to_plain(paths: List[str], common: dict, optimizer, model_chunks,
                    expert: bool | None = None) -> dict:
    """The ``state_dict`` of the plain ``optimizer`` (FP32 or Float16) equal to a distributed
    optimizer's checkpoint: its common part ``common`` and the shard files ``paths`` of all DP
    ranks (a list, or :class:`ShardFiles`). ``expert``: for one part of a chained optimizer,
    which parameters it holds (True: the expert ones, False: the dense ones; None: all).

    Raises:
        ValueError: if no shard file is given, a parameter is not covered, or the parameter groups
            do not match ``model_chunks``.
    """
    if not paths:
        raise ValueError("the checkpoint was saved with --use-distributed-optimizer but has no "
                         "distrib_optim_dp_*.pt file; load with --no-load-optim")
    pieces, step = read_shards(paths)
    groups = get_param_groups(model_chunks, optimizer.config.weight_decay, expert)
    if len(common["param_groups"]) != len(groups):
        raise ValueError("optimizer checkpoint saved with --use-distributed-optimizer: parameter "
                         "groups do not match the model; load with --no-load-optim")
    names = param_names(model_chunks)
    state, torch_groups, mains = {}, [], []
    index = 0
    for group, saved in zip(groups, common["param_groups"]):
        ids, group_mains = [], []
        for p in group["params"]:
            values = _full_values(pieces, names[p], p.numel(), f"optimizer shards {paths[0]}...")
            state[index] = {"step": torch.tensor(float(step)),
                            "exp_avg": values["exp_avg"].view(p.shape),
                            "exp_avg_sq": values["exp_avg_sq"].view(p.shape)}
            if p.dtype in _HALF:
                group_mains.append(values["param"].view(p.shape))
            ids.append(index)
            index += 1
        torch_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        mains.append(group_mains)
    torch_sd = {"state": state, "param_groups": torch_groups}
    if not optimizer.keeps_fp32_main_params:
        return torch_sd
    out = {"optimizer": torch_sd, "fp32_from_fp16_params": mains}
    if "grad_scaler" in common:
        out["grad_scaler"] = common["grad_scaler"]
    return out
