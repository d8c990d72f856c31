"""Legacy checkpoints (``--ckpt-format torch``) with experts: what a rank reads at another
expert-parallel or expert-tensor-parallel layout.

At EP > 1 a legacy checkpoint has one folder per (tensor, pipeline, expert) rank,
``mp_rank_TT[_PPP]_EEE`` (Megatron-LM's ``get_checkpoint_name``). Its ``model_optim_rng.pt`` holds
that EP rank's experts ``[E / EP, ...]`` (global experts ``e * E / EP ...``) and the dense
weights; with ``--use-distributed-optimizer`` every rank of DP x CP writes its shard
``distrib_optim_dp_DDD.pt`` into its own folder, its expert records on the global expert axis
(:func:`megatron.core.optimizer.distrib_optimizer_checkpoint.to_global_ranges`). So:

* the dense shards of one tensor and pipeline rank are spread over its ``_EEE`` folders;
* the expert shards of one pipeline rank are spread over every folder of that pipeline rank
  (the experts are sharded over expert-DP, which may span tensor ranks); each shard file
  records its ``expert_tensor_rank``, and a rank reads the expert records of its own;
* a file's experts are expert-TP slice t at expert-TP = TP (Megatron-LM's), else whole
  (gathered over expert-TP at the save); ``expert_tensor_slice`` records which
  (:func:`file_expert_slice`);
* a rank loading at another EP or expert-TP (same TP and PP: the legacy format keeps those)
  takes the dense weights from a folder of its tensor and pipeline rank and its experts from the
  whole experts of the saved EP ranks holding its rows (a file of whole ones, or the slices of
  tensor ranks 0 .. k-1 merged), cut to its expert-TP slice (:func:`assemble_experts`); the
  distributed optimizer's expert records are re-cut alike (:func:`resliced_shard_files`).

Which single group ``mp_rank_TT_XXX`` names is ambiguous in Megatron-LM's naming (a pipeline
rank, or an expert rank at PP = 1): :func:`saved_with_expert_folders` decides it.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from megatron.checkpointing.expert_slices import cut, merge
from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError, load_torch_file
from megatron.core.distributed.expert_params import is_expert_param
from megatron.core.optimizer.distrib_optimizer_checkpoint import ShardFiles, expert_ranges

_FOLDER = re.compile(r"mp_rank_(\d{2})((?:_\d{3}){0,2})")
MODEL_FILE = "model_optim_rng.pt"


def _names(folder: str) -> List[Tuple[str, int, List[int]]]:
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        match = _FOLDER.fullmatch(name)
        if match and os.path.isdir(os.path.join(folder, name)):
            out.append((name, int(match.group(1)), [int(x) for x in match.group(2).split("_")[1:]]))
    return out


def saved_with_expert_folders(folder: str, run_expert_parallel: bool, read_saved_args) -> bool:
    """Whether the legacy checkpoint ``folder`` has expert-rank folders (saved at EP > 1).

    ``mp_rank_TT_PPP_EEE`` says so; no ``_XXX`` says not. ``mp_rank_TT_XXX`` is read as the
    expert rank by a run at EP > 1 (as before), else from the ``args`` one shard recorded
    (``expert_model_parallel_size``, by ``read_saved_args(path)``; read only in that case)."""
    names = _names(folder)
    if any(len(groups) == 2 for _, _, groups in names):
        return True
    single = [name for name, _, groups in names if len(groups) == 1]
    if not single:
        return False
    if run_expert_parallel:
        return True
    args = read_saved_args(os.path.join(folder, single[0], MODEL_FILE))
    return int(args.get("expert_model_parallel_size") or 1) > 1


def shard_folders(folder: str, expert_folders: bool) -> Dict[Tuple[int, int, int], str]:
    """``{(tensor rank, pipeline rank, expert rank): path}`` of the shard folders of the
    legacy checkpoint ``folder`` (``expert_folders``: :func:`saved_with_expert_folders`)."""
    out = {}
    for name, tp, groups in _names(folder):
        pp, ep = 0, 0
        if len(groups) == 2:
            pp, ep = groups
        elif len(groups) == 1:
            pp, ep = (0, groups[0]) if expert_folders else (groups[0], 0)
        out[(tp, pp, ep)] = os.path.join(folder, name)
    return out


@dataclass
class LegacyExpertPlan:
    """What one rank reads of a legacy checkpoint folder.

    Attributes:
        model_file: the ``model_optim_rng.pt`` whose dense weights, optimizer common part,
            scheduler and RNG states it loads.
        expert_folders: ``{saved EP rank: {tensor rank: model_optim_rng.pt}}`` of this
            pipeline rank: where the experts of each saved EP rank are.
        moved: ``model_file`` does not hold this rank's experts (another EP, or its own file
            missing): they are taken from ``expert_folders``.
        saved_ep: the EP size the checkpoint was saved at.
        shard_files: the distributed optimizer's shard files (:class:`ShardFiles`).
    """

    model_file: str
    expert_folders: Dict[int, Dict[int, str]]
    moved: bool
    saved_ep: int
    shard_files: ShardFiles


def plan(folder: str, pg_collection, model_chunks, own_name: str, *, shard_pattern: str,
         read_saved_args) -> LegacyExpertPlan:
    """Where this rank reads from the legacy checkpoint ``folder``; ``own_name``: its file at
    its own layout (``checkpoint_name_of``), kept when it exists and the EP sizes agree (and
    named in the error when nothing fits); ``shard_pattern``: the glob of the distributed
    optimizer's shard files in a folder; ``read_saved_args(path)``: a shard's ``args``."""
    tp, pp, ep = pg_collection.tp, pg_collection.pp, pg_collection.ep
    folders = shard_folders(folder, saved_with_expert_folders(folder, ep.size > 1,
                                                              read_saved_args))
    saved_ep = 1 + max((e for _, _, e in folders), default=0)
    mine = sorted(e for (t, p, e) in folders if (t, p) == (tp.rank, pp.rank))
    model_file = own_name
    moved = not (saved_ep == ep.size and os.path.isfile(own_name))
    if moved and mine:
        model_file = os.path.join(folders[(tp.rank, pp.rank, mine[0])], MODEL_FILE)
    by_ep: Dict[int, Dict[int, str]] = {}
    for (t, p, e), path in folders.items():
        if p == pp.rank:
            by_ep.setdefault(e, {})[t] = os.path.join(path, MODEL_FILE)

    def shards(paths):
        return sorted(f for path in paths for f in glob.glob(os.path.join(path, shard_pattern)))

    dense = shards(folders[(tp.rank, pp.rank, e)] for e in mine) if mine else \
        shards([os.path.dirname(own_name)])
    experts = shards(path for (_, p, _), path in folders.items() if p == pp.rank)
    ranges = expert_ranges(model_chunks, ep.rank)
    return LegacyExpertPlan(model_file, by_ep, moved, saved_ep,
                            ShardFiles(dense, experts if ranges else [], ranges,
                                       pg_collection.expt_tp.rank))


def file_expert_slice(state: dict, tensor_rank: int) -> Tuple[int, int]:
    """``(rank, size)``: the expert-TP slice that the experts of a legacy ``model_optim_rng.pt``
    (of tensor rank ``tensor_rank``'s folder) are; ``(0, 1)``: whole experts.

    Recorded as ``expert_tensor_slice``; files without it (saved before it was recorded, or by
    Megatron-LM) hold their run's expert-TP slice, which their folder names only at expert-TP =
    TP (slice t in tensor rank t's folder) or expert-TP 1 (whole).

    Raises:
        CheckpointError: a file without the record saved at an expert-TP > 1 other than TP
            (Megatron-LM writes one file per tensor rank there, so some slices were never
            written)."""
    recorded = state.get("expert_tensor_slice")
    if recorded is not None:
        return int(recorded[0]), int(recorded[1])
    args = state.get("args") if isinstance(state.get("args"), dict) else {}
    tp = int(args.get("tensor_model_parallel_size") or 1)
    size = int(args.get("expert_tensor_parallel_size") or tp)
    if size == 1:
        return 0, 1
    if size == tp:
        return tensor_rank, size
    raise CheckpointError(
        f"the legacy checkpoint's experts were saved at --expert-tensor-parallel-size {size} "
        f"with --tensor-model-parallel-size {tp} without a record of which slice each file holds "
        "(Megatron-LM's torch format writes one file per tensor rank there, so expert slices "
        "are missing): resave it with --ckpt-format torch_dist")


def saved_optimizer_expert_tp(state: dict) -> int:
    """The expert-TP size whose slices the optimizer state of a legacy ``model_optim_rng.pt``
    and its ``distrib_optim_dp_*.pt`` shards hold: the saving run's (recorded as
    ``expert_tensor_parallel_size``, else its ``args``; None: TP)."""
    if state.get("expert_tensor_parallel_size") is not None:
        return int(state["expert_tensor_parallel_size"])
    args = state.get("args") if isinstance(state.get("args"), dict) else {}
    tp = int(args.get("tensor_model_parallel_size") or 1)
    return int(args.get("expert_tensor_parallel_size") or tp)


def expert_keys(module: torch.nn.Module) -> List[str]:
    """The state-dict keys of ``module``'s expert parameters."""
    return [n for n, p in module.named_parameters() if is_expert_param(p)]


def _whole_experts(key: str, name: str, files: Dict[int, str], tensor_rank: int, read):
    """The whole experts of one saved EP rank: its file (own tensor rank's first) when it holds
    them whole, else the slices ``u`` of ``k`` from the folders of tensor ranks ``0 .. k-1``
    merged (slices are saved only at expert-TP = TP)."""
    first = tensor_rank if tensor_rank in files else min(files)
    rank, size = file_expert_slice(read(files[first]), first)
    if size == 1:
        return read(files[first])[key][name]
    parts = []
    for u in range(size):
        if u not in files:
            raise CheckpointError(
                f"the legacy checkpoint's experts are split over --expert-tensor-parallel-size "
                f"{size}, but slice {u} (the folder of tensor rank {u}) is missing: it holds "
                f"only {sorted(files)}")
        got = file_expert_slice(read(files[u]), u)
        if got != (u, size):
            raise CheckpointError(f"{files[u]} holds expert-TP slice {got[0]} of {got[1]}, "
                                  f"expected {u} of {size}: the folders are mixed up")
        parts.append(read(files[u])[key][name])
    return merge(name, parts)


def assemble_experts(state: dict, key: str, module: torch.nn.Module, plan_: LegacyExpertPlan,
                     pg_collection, read) -> None:
    """Replace the expert tensors of ``state[key]`` (a model chunk's state dict) by this rank's
    part of the global whole experts: the saved EP ranks' experts (whole, or their expert-TP
    slices merged: :func:`_whole_experts`) concatenated in EP order, rows ``ep.rank * E_local
    ...`` (E_local: the module's), cut to this run's expert-TP slice. ``read(path)`` returns a
    file's state (cached by the caller).

    Raises:
        CheckpointError: the files hold another number of experts than the model's (an
            ``mp_rank_*_EEE`` folder missing, or another ``--num-experts``), or a slice is
            missing."""
    ep, etp = pg_collection.ep, pg_collection.expt_tp
    folders = plan_.expert_folders
    saved = sorted(folders)

    def whole_of(e, name):
        return _whole_experts(key, name, folders[e], pg_collection.tp.rank, read)

    for name in expert_keys(module):
        local = module.get_parameter(name).shape[0]
        total = local * ep.size
        lo, hi = ep.rank * local, (ep.rank + 1) * local
        per = total // plan_.saved_ep
        if saved == list(range(plan_.saved_ep)) and per * plan_.saved_ep == total:
            first, last = lo // per, -(-hi // per)  # the saved EP ranks holding rows lo .. hi
            whole = torch.cat([whole_of(e, name) for e in range(first, last)])
            if whole.shape[0] == (last - first) * per:
                state[key][name] = cut(name, whole[lo - first * per:hi - first * per],
                                       etp.rank, etp.size)
                continue
        counts = [whole_of(e, name).shape[0] for e in saved]
        dirs = sorted({os.path.dirname(f) for e in saved for f in folders[e].values()})
        raise CheckpointError(
            f"the legacy checkpoint's expert folders {dirs} hold {sum(counts)} experts of "
            f"{key}.{name} ({counts} per EP rank), the model {total}: an mp_rank_*_EEE folder "
            "is missing, or --num-experts differs from the saving run's")


def resliced_shard_files(shard_files: ShardFiles, model_chunks, pg_collection,
                         saved_size: int) -> ShardFiles:
    """``shard_files`` whose expert records (saved at expert-TP ``saved_size``, other than this
    run's) are re-cut: for each expert parameter the records of every saved expert-TP rank ``u``
    (files recording ``expert_tensor_rank`` u) are joined on the global expert axis into this
    rank's experts' slice u, the slices merged into whole experts and cut to this rank's
    expert-TP slice; one record covers the parameter whole (fp32 values and Adam moments)."""
    from megatron.core.distributed.expert_params import is_expert_param as expert
    from megatron.core.optimizer.distrib_optimizer_checkpoint import (STATE_KEYS, _localize,
                                                                      param_names)

    ep, etp = pg_collection.ep, pg_collection.expt_tp
    params = {name: p for p, name in param_names(model_chunks).items() if expert(p)}
    files = list(shard_files.expert)

    def records() -> Dict[str, list]:
        by_rank: Dict[int, list] = {}
        for path in files:
            sd = load_torch_file(path, what="distributed-optimizer shard")
            if "expert_tensor_rank" not in sd:
                raise ValueError(f"{path} records no expert_tensor_rank: its expert state "
                                 "loads only at the expert-TP it was saved at")
            by_rank.setdefault(int(sd["expert_tensor_rank"]), []).append(sd["params"])
        out = {}
        for name, p in params.items():
            local = p.shape[0]
            per_expert = p.numel() // local * etp.size // saved_size  # one saved slice
            offset, numel = ep.rank * local * per_expert, local * per_expert
            slices = {k: [] for k in STATE_KEYS}
            for u in range(saved_size):
                values = {k: torch.zeros(numel, dtype=torch.float32) for k in STATE_KEYS}
                covered = 0
                for saved in by_rank.get(u, []):
                    rec = saved.get(name)
                    part = _localize(rec, offset, numel) if rec is not None else None
                    if part is not None:
                        s, t = part["range"]
                        covered += t - s
                        for k in STATE_KEYS:
                            values[k][s:t] = part[k]
                if covered != numel:
                    raise ValueError(
                        f"distributed-optimizer shards {files[0]}...: expert-TP slice {u} of "
                        f"{saved_size} of {name} has {covered} of its {numel} elements (a "
                        "distrib_optim_dp_*.pt file is missing); load with --no-load-optim")
                for k in STATE_KEYS:
                    slices[k].append(values[k].view(local, *_slice_shape(name, p, etp.size,
                                                                          saved_size)))
            rec = {"range": [0, p.numel()]}
            for k in STATE_KEYS:
                rec[k] = cut(name, merge(name, slices[k]), etp.rank, etp.size).reshape(-1)
            out[name] = [rec]
        return out

    return ShardFiles(shard_files.dense, [], shard_files.expert_ranges, None,
                      expert_records=records)


def _slice_shape(name: str, p: torch.Tensor, run_size: int, saved_size: int) -> Tuple[int, int]:
    """One expert's ``[rows, cols]`` in a slice of ``saved_size`` of the parameter ``p`` (this
    run's slice of ``run_size``)."""
    a, b = p.shape[1:]
    if name.endswith("weight2"):
        return a, b * run_size // saved_size
    return a * run_size // saved_size, b
