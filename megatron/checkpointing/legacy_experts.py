"""Legacy checkpoints (``--ckpt-format torch``) with experts: what a rank reads at another
expert-parallel layout.

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
* a rank loading at another EP (same TP and PP: the legacy format keeps those) takes the dense
  weights from a folder of its tensor and pipeline rank and its experts from the global tensor
  assembled from one folder per saved EP rank (its own tensor rank's; at expert-TP 1, where
  experts are whole on each tensor rank, any tensor rank's).

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

from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
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
        expert_files: one ``model_optim_rng.pt`` per saved EP rank, in EP order (their expert
            tensors concatenated are the global ones); empty when ``model_file`` holds exactly
            this rank's experts (same EP, same folder).
        saved_ep: the EP size the checkpoint was saved at.
        shard_files: the distributed optimizer's shard files (:class:`ShardFiles`).
    """

    model_file: str
    expert_files: List[str]
    saved_ep: int
    shard_files: ShardFiles

    @property
    def reassembles(self) -> bool:
        return bool(self.expert_files)


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
    model_file, expert_files = own_name, []
    if not (saved_ep == ep.size and os.path.isfile(own_name)):
        if mine:
            model_file = os.path.join(folders[(tp.rank, pp.rank, mine[0])], MODEL_FILE)
        expert_files = _expert_model_files(folders, tp.rank, pp.rank,
                                           pg_collection.expt_tp.size)

    def shards(paths):
        return sorted(f for path in paths for f in glob.glob(os.path.join(path, shard_pattern)))

    dense = shards(folders[(tp.rank, pp.rank, e)] for e in mine) if mine else \
        shards([os.path.dirname(own_name)])
    experts = shards(path for (_, p, _), path in folders.items() if p == pp.rank)
    ranges = expert_ranges(model_chunks, ep.rank)
    return LegacyExpertPlan(model_file, expert_files, saved_ep,
                            ShardFiles(dense, experts if ranges else [], ranges,
                                       pg_collection.expt_tp.rank))


def _expert_model_files(folders, tp_rank: int, pp_rank: int, expert_tp: int) -> List[str]:
    """One ``model_optim_rng.pt`` per saved EP rank of pipeline rank ``pp_rank``: its own tensor
    rank's folder, else (experts whole on each tensor rank, expert-TP 1) any tensor rank's.

    Raises:
        CheckpointError: at expert-TP > 1, an EP rank saved only in other tensor ranks' folders
            (their expert slices are other ones)."""
    by_ep: Dict[int, Dict[int, str]] = {}
    for (t, p, e), path in folders.items():
        if p == pp_rank:
            by_ep.setdefault(e, {})[t] = os.path.join(path, MODEL_FILE)
    out = []
    for e in sorted(by_ep):
        if tp_rank in by_ep[e]:
            out.append(by_ep[e][tp_rank])
        elif expert_tp == 1:
            out.append(by_ep[e][min(by_ep[e])])
        else:
            raise CheckpointError(
                f"the legacy checkpoint holds the experts of expert-parallel rank {e} only in "
                f"the folders of other tensor ranks ({sorted(by_ep[e])}), whose expert slices "
                f"differ at --expert-tensor-parallel-size {expert_tp}; load it at the "
                "expert-parallel layout it was saved with, or save with --ckpt-format torch_dist")
    return out


def expert_keys(module: torch.nn.Module) -> List[str]:
    """The state-dict keys of ``module``'s expert parameters."""
    return [n for n, p in module.named_parameters() if is_expert_param(p)]


def assemble_experts(state: dict, key: str, module: torch.nn.Module, expert_files: List[str],
                     ep, read) -> None:
    """Replace the expert tensors of ``state[key]`` (a model chunk's state dict) by this rank's
    slice of the global tensors: the files' ``[E_saved_local, ...]`` tensors concatenated in
    EP order, then rows ``ep.rank * E_local ...`` (E_local: the module's; ``ep``: this run's
    expert-parallel group). ``read(path)`` returns a file's state (cached by the caller).

    Raises:
        CheckpointError: the files hold another number of experts than the model's
            (an ``mp_rank_*_EEE`` folder missing, or another ``--num-experts``)."""
    for name in expert_keys(module):
        local = module.get_parameter(name).shape[0]
        parts = [read(path)[key][name] for path in expert_files]
        whole = torch.cat(parts)
        if whole.shape[0] != local * ep.size:
            raise CheckpointError(
                f"the legacy checkpoint's expert folders {[os.path.dirname(f) for f in expert_files]}"
                f" hold {whole.shape[0]} experts of {key}.{name} ({[p.shape[0] for p in parts]} "
                f"per EP rank), the model {local * ep.size}: an mp_rank_*_EEE folder is missing, "
                "or --num-experts differs from the saving run's")
        state[key][name] = whole[ep.rank * local:(ep.rank + 1) * local].clone()
