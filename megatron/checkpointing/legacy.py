"""Checkpoints in Megatron-LM's legacy layout (``--ckpt-format torch``).

Layout (Megatron-LM ``get_checkpoint_name``)::

    SAVE/latest_checkpointed_iteration.txt     "100" or "release"
    SAVE/iter_0000100/mp_rank_TT/model_optim_rng.pt        PP = 1
    SAVE/iter_0000100/mp_rank_TT_PPP/model_optim_rng.pt    PP > 1
    SAVE/release/...                                       same, written by conversion tools

One file per (tensor rank, pipeline rank), written by data-parallel rank 0 of context-parallel
rank 0 (the other ranks of the DP x CP group hold replicas of the same weights, so a checkpoint
loads at any DP and CP size). It holds ``model``
(``model0``, ``model1``, ... with virtual stages), ``optimizer``, ``opt_param_scheduler``,
``iteration``, ``consumed_train_samples``, ``consumed_valid_samples``, ``args`` (a dict of plain
JSON-compatible values, so ``torch.load(weights_only=True)`` reads it), ``rng_state`` and
``checkpoint_version`` 3.0. With ``--use-distributed-optimizer`` every rank of the DP x CP group
(the optimizer's sharding group) also writes its optimizer shard ``distrib_optim_dp_DDD.pt``
beside it, ``DDD`` its rank in that group (per parameter name and element range, so a load at
another DP or CP size re-cuts the shards); ``optimizer`` then holds the common part. At EP > 1
the folders are ``mp_rank_TT[_PPP]_EEE`` (one per expert-parallel rank, holding its experts: slice
t of expert-TP = TP, else whole experts) and a model with experts loads at another EP, expert-TP
or DP size: :mod:`megatron.checkpointing.legacy_experts`.

Crash safety: every rank writes into ``iter_XXXXXXX.tmp/`` (each file under a temporary name,
flushed and renamed); after all ranks report success, rank 0 renames the folder to its final name
and only then replaces the tracker file atomically. A kill at any moment leaves the previous
checkpoint loadable.

What a save deletes, and why it is this job's to delete (rank 0, in this order): the staging folder
``iter_N.tmp`` of the iteration it saves (a save of it killed earlier), its own staging folder
when the save failed, the published ``iter_N`` it replaces (moved to ``iter_N.old`` first),
leftover ``iter_*.tmp`` / ``iter_*.old`` folders of killed saves, and with
``--keep-last-checkpoints`` older checkpoints (:func:`megatron.checkpointing.checkpoint_folder.checkpoints_to_remove`). A training job holds
the folder's lock (:mod:`megatron.checkpointing.save_folder`) and every save first checks it is still its own,
so none of these can be another live job's files.
"""

from __future__ import annotations

import glob
import os
import shutil

import torch.distributed as dist

from megatron.checkpointing.checkpoint_folder import (TRACKER_FILENAME, agree_on_load_error,
                                                     agree_on_save_error, get_checkpoint_dir,
                                                     load_scheduler_state, prepare_staging,
                                                     publish, write_atomic)
from megatron.core.dist_checkpointing.checkpoint_io import (CheckpointError, UnreadableFileError,
                                                          load_torch_file)
from megatron.checkpointing.expert_slices import gather_whole
from megatron.checkpointing.legacy_experts import (assemble_experts, expert_keys,
                                                  file_expert_slice, plan as legacy_plan,
                                                  resliced_shard_files,
                                                  saved_optimizer_expert_tp)
from megatron.config.saved_args import check_resume_precision, plain
from megatron.core.distributed.model_chunk import as_model_chunk
from megatron.core.optimizer.distrib_optimizer_checkpoint import expert_ranges, to_global_ranges
from megatron.core.process_groups import layout_groups
from megatron.model import unwrap_model
from megatron.checkpointing.rng_state import get_rng_state, set_rng_state

CHECKPOINT_VERSION = 3.0


# Names ------------------------------------------------------------------------------------------

def distrib_optim_filename(data_parallel_rank) -> str:
    """The distributed optimizer's shard file of one DP rank, beside ``model_optim_rng.pt``."""
    rank = data_parallel_rank if isinstance(data_parallel_rank, str) else f"{data_parallel_rank:03d}"
    return f"distrib_optim_dp_{rank}.pt"


def get_checkpoint_name(checkpoints_path: str, iteration: int, release: bool = False, *,
                        pipeline_parallel: bool, tensor_rank: int,
                        pipeline_rank: int | None = None,
                        expert_parallel: bool = False, expert_rank: int | None = None) -> str:
    """Path of one (tensor rank, pipeline rank[, expert rank])'s ``model_optim_rng.pt``
    (Megatron-LM's naming ``mp_rank_TT[_PPP][_EEE]``; ``pipeline_rank`` only matters with
    ``pipeline_parallel``, ``expert_rank`` with ``expert_parallel``, EP > 1)."""
    sub = f"mp_rank_{tensor_rank:02d}" + (f"_{pipeline_rank:03d}" if pipeline_parallel else "")
    if expert_parallel:
        sub += f"_{expert_rank:03d}"
    return os.path.join(get_checkpoint_dir(checkpoints_path, iteration, release), sub,
                        "model_optim_rng.pt")


def checkpoint_name_of(checkpoints_path: str, iteration: int, pg_collection,
                       release: bool = False) -> str:
    """This rank's ``model_optim_rng.pt`` (its tensor-, pipeline- and, at EP > 1,
    expert-parallel ranks)."""
    pp, ep = pg_collection.pp, pg_collection.ep
    return get_checkpoint_name(checkpoints_path, iteration, release, pipeline_parallel=pp.size > 1,
                               tensor_rank=pg_collection.tp.rank, pipeline_rank=pp.rank,
                               expert_parallel=ep.size > 1, expert_rank=ep.rank)


def writes_model_file(pg_collection) -> bool:
    """Whether this rank writes its folder's ``model_optim_rng.pt``: DP rank 0 of CP rank 0 (the
    ranks of DP x CP hold the same weights); at EP > 1, where the ranks of DP x CP hold different
    experts, the first rank of DP x CP with this rank's expert-parallel rank (one writer per
    ``mp_rank_TT[_PPP]_EEE`` folder)."""
    g = pg_collection
    if g.ep.size == 1:
        return g.dp_cp.rank == 0
    expert_groups = layout_groups(g.world_size, g.tp.size, g.pp.size, g.cp.size, g.ep.size,
                                  g.expt_tp.size)["expert"]
    ep_rank = {r: group.index(r) for group in expert_groups for r in group}
    first = min(r for r in g.dp_cp.ranks if ep_rank[r] == g.ep.rank)
    return g.rank == first


# RNG states -------------------------------------------------------------------------------------

def _model_keys(model_chunks) -> list[str]:
    return ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]


# Save -------------------------------------------------------------------------------------------

def save_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler, config,
                    pg_collection, *, run_flags: dict, consumed_train_samples: int,
                    consumed_valid_samples: int, protect=()) -> str:
    """Save a checkpoint of ``iteration`` under ``config.save``. Collective over the world.

    Args:
        config: the run's :class:`~megatron.config.CheckpointConfig` (``save``,
            ``no_save_optim``, ``no_save_rng``, ``keep_last_checkpoints``).
        pg_collection: this rank's process groups (its shard's name; rank 0 of the DP x CP group
            writes it).
        run_flags: the plain ``args`` dict the shard records
            (:func:`megatron.config.checkpoint_args` of the run's configuration).
        protect: checkpoint folders ``--keep-last-checkpoints`` must keep (the last one written
            before the run's latest non-finite iteration).

    Returns:
        the final checkpoint folder.

    Raises:
        CheckpointError: on every rank if any rank failed to write (e.g. a full disk), or the
            folder's lock is another job's; the previous checkpoint and the tracker file stay
            untouched.
    """
    save_dir = config.save
    dp, dp_cp = pg_collection.dp, pg_collection.dp_cp
    final_dir = get_checkpoint_dir(save_dir, iteration)
    staging = final_dir + ".tmp"
    device = next(unwrap_model(model_chunks[0]).parameters()).device
    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            prepare_staging(save_dir, staging)
        except (CheckpointError, OSError) as exc:
            error = str(exc)
    agree_on_save_error(error, device, f"saving the checkpoint of iteration {iteration} failed on "
                        "rank 0; nothing was written")

    for chunk in model_chunks:  # pending all-gathers of the distributed optimizer: save new weights
        as_model_chunk(chunk).finish_param_sync()
    save_optim = optimizer is not None and not config.no_save_optim
    name = checkpoint_name_of(save_dir, iteration, pg_collection).replace(final_dir, staging, 1)
    rng_states = None
    if not config.no_save_rng:  # one per DP rank, as Megatron-LM keeps them
        rng_states = [None] * dp.size
        dist.all_gather_object(rng_states, get_rng_state(), group=dp.group)
    if save_optim and optimizer.kind == "distributed":  # distributed optimizer: per shard
        shard = os.path.join(os.path.dirname(name), distrib_optim_filename(dp_cp.rank))
        try:
            os.makedirs(os.path.dirname(shard), exist_ok=True)
            # expert records on the global expert axis (legacy_experts.py)
            write_atomic(to_global_ranges(optimizer.parameter_state(),
                                          expert_ranges(model_chunks, pg_collection.ep.rank),
                                          pg_collection.expt_tp.rank), shard)
        except OSError as exc:
            error = f"rank {rank} could not write {shard}: {exc}"
    # At expert-TP > 1 other than TP a folder's name (its tensor rank) does not say which
    # expert-TP slice it would hold, and some slices would have no folder: its file holds whole
    # experts, gathered over expert-TP (collective: every rank of the group joins).
    etp = pg_collection.expt_tp
    whole = etp.size > 1 and etp.size != pg_collection.tp.size
    experts = {}
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        module = unwrap_model(chunk)
        experts[key] = {n: gather_whole(n, module.get_parameter(n), etp) if whole else None
                        for n in expert_keys(module)}
    if writes_model_file(pg_collection):
        state = {
            "args": {k: plain(v) for k, v in run_flags.items()},
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration, "consumed_train_samples": consumed_train_samples,
            "consumed_valid_samples": consumed_valid_samples,
            "optimizer": optimizer.state_dict() if save_optim else None,
            "opt_param_scheduler": (opt_param_scheduler.state_dict()
                                    if opt_param_scheduler is not None else None),
        }
        if rng_states is not None:
            state["rng_state"] = rng_states
        for key, chunk in zip(_model_keys(model_chunks), model_chunks):
            state[key] = unwrap_model(chunk).state_dict()
            state[key].update({n: t for n, t in experts[key].items() if t is not None})
        if any(experts.values()):  # which expert-TP slice the file's experts are; the
            # expert-TP of the optimizer state (distributed: its shards' records)
            state["expert_tensor_slice"] = [0, 1] if whole or etp.size == 1 else \
                [etp.rank, etp.size]
            state["expert_tensor_parallel_size"] = etp.size
        try:
            os.makedirs(os.path.dirname(name), exist_ok=True)
            write_atomic(state, name)
        except OSError as exc:
            error = f"rank {rank} could not write {name}: {exc}"
    if error is not None:
        error += (f"; the previous checkpoint and {TRACKER_FILENAME} are intact (free space "
                  "under --save, then restart with --load)")
    agree_on_save_error(error, device, f"saving the checkpoint of iteration {iteration} failed on "
                        "another rank; the previous checkpoint is intact",
                        cleanup=lambda: rank == 0 and shutil.rmtree(staging, ignore_errors=True))

    if rank == 0:
        publish(save_dir, staging, final_dir, iteration, config.keep_last_checkpoints,
                 protect=protect)
    dist.barrier()
    return final_dir


# Load -------------------------------------------------------------------------------------------

def looks_complete(folder: str) -> bool:
    """Every ``mp_rank_*`` shard of ``folder`` present and a whole zip archive (``torch.save``'s
    format: a truncated file lacks the central directory at its end), no temporary files left."""
    import zipfile

    shards = glob.glob(os.path.join(folder, "mp_rank_*", "model_optim_rng.pt"))
    stray = glob.glob(os.path.join(folder, "mp_rank_*", "*.tmp"))
    return bool(shards) and not stray and all(
        os.path.isfile(f) and zipfile.is_zipfile(f) for f in shards)  # a pipe is never opened


def _torch_load(path: str) -> dict:
    """This rank's shard ``path`` (:func:`megatron.core.dist_checkpointing.checkpoint_io.load_torch_file`: CRCs checked,
    tensors and plain values only).

    Raises:
        UnreadableFileError: missing (naming what its folder holds), damaged or refused.
    """
    if not os.path.lexists(path):  # one that is no file: load_torch_file names what it is
        folder = os.path.dirname(os.path.dirname(path))
        present = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        held = (f"; {folder} holds {present} (a partial checkpoint, or one saved with another "
                "tensor/pipeline-parallel layout)" if present else "")
        raise UnreadableFileError(f"checkpoint shard {path} does not exist{held}.")
    return load_torch_file(path, what="checkpoint shard")


def check_state_dict_shapes(model_state: dict, ckpt_state: dict, path: str) -> None:
    """Raise :class:`CheckpointError` naming the first tensor whose name or shape differs."""
    missing = [k for k in model_state if k not in ckpt_state]
    unexpected = [k for k in ckpt_state if k not in model_state]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit the model: missing tensors "
                              f"{missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, tensor in model_state.items():
        theirs = ckpt_state[name]
        if tuple(theirs.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {path}: tensor {name} has shape {tuple(theirs.shape)} in the checkpoint "
                f"but {tuple(tensor.shape)} in the model; the model flags (sizes, vocabulary, "
                "tensor-parallel size) must match the run that saved it")


def load_checkpoint(load_dir: str, iteration: int, release: bool, model_chunks, optimizer,
                    opt_param_scheduler, config, pg_collection, *, run_flags: dict,
                    explain) -> dict:
    """Load the legacy checkpoint of ``iteration`` (or ``release``) under ``load_dir``, at the
    layout it was saved with, into the model (and optimizer, scheduler, RNG unless told
    otherwise); ``explain(message)``: the message with the last complete checkpoint to fall back
    on (the dispatcher's, :func:`megatron.checkpointing.last_complete_hint`).

    Returns:
        :func:`megatron.checkpointing.load_checkpoint`'s result.

    Raises:
        CheckpointError: a missing, corrupt or misfitting shard (agreed over the ranks).
    """
    path = checkpoint_name_of(load_dir, iteration, pg_collection, release)
    device = next(unwrap_model(model_chunks[0]).parameters()).device
    experts = None
    if any(expert_keys(unwrap_model(c)) for c in model_chunks):  # the files of its experts
        experts = legacy_plan(get_checkpoint_dir(load_dir, iteration, release), pg_collection,
                              model_chunks, path, shard_pattern=distrib_optim_filename("*"),
                              read_saved_args=read_saved_args)
        path = experts.model_file
    for chunk in model_chunks:  # ZeRO-3: gather the sharded parameters (every rank, before any
        as_model_chunk(chunk).finish_param_sync()  # can fail); loading reshards them
    error = None
    try:
        result = _load_state(path, release, model_chunks, optimizer, opt_param_scheduler, config,
                             pg_collection, run_flags, experts)
    except UnreadableFileError as exc:  # a shard of this rank: name a checkpoint to fall back on
        error = UnreadableFileError(explain(str(exc)))
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks know
        error = exc
    # Every rank learns of a failure on any rank, instead of waiting for it in the next
    # collective; a checkpoint the run cannot use is said once, by the lowest rank that found it.
    agree_on_load_error(error, device, get_checkpoint_dir(load_dir, iteration, release))
    if dist.get_rank() == 0:
        print(f" loaded checkpoint from {load_dir} at iteration "
              f"{'release' if release else iteration}", flush=True)
    return result


def _load_optimizer(optimizer, saved: dict, shard_paths, model_chunks) -> None:
    """Load the optimizer state whichever optimizer saved it: the distributed optimizer re-cuts
    the per-DP-rank shards at this run's DP size or takes a plain optimizer's state whole; the
    plain optimizer takes a distributed optimizer's shards reassembled."""
    distributed = optimizer.kind == "distributed"
    try:
        if saved.get("distributed_optimizer") and not distributed:
            from megatron.core.optimizer.distrib_optimizer_checkpoint import shards_to_plain
            if "chained_optimizers" in saved:  # dense and expert parts, each of its params
                saved = {"chained_optimizers": [
                    shards_to_plain(shard_paths, sd, part, model_chunks, part.expert)
                    for part, sd in zip(optimizer.parts, saved["chained_optimizers"])]}
            else:
                saved = shards_to_plain(shard_paths, saved, optimizer, model_chunks)
        optimizer.load_state_dict(saved)
        if distributed:
            optimizer.load_parameter_state(shard_paths if saved.get("distributed_optimizer")
                                           else [])
    except ValueError as exc:  # shards missing or not covering this run's parameters
        raise CheckpointError(str(exc)) from None


def _read_shard(path: str, config, pg_collection, run_flags: dict,
                expert_folders: bool | None = None) -> dict:
    """This rank's shard: ours as saved, or another system's (Megatron-LM) translated to ours by
    :func:`megatron.checkpointing.foreign.state_for_load` (notes printed on rank 0)."""
    from megatron.checkpointing import foreign as foreign_checkpoints

    probe = path if os.path.isfile(path) else foreign_checkpoints.first_shard(
        os.path.dirname(os.path.dirname(path)))
    state = None
    if probe is not None:
        run = dict(run_flags, load=config.load, finetune=config.finetune,
                   no_load_optim=config.no_load_optim)
        state = foreign_checkpoints.state_for_load(probe, path, run, pg_collection.tp.size,
                                                   pg_collection.pp.size, pg_collection.ep.size)
    if state is None:
        folder = os.path.dirname(os.path.dirname(path))
        check_saved_layout(folder, config.load, pg_collection.tp.size, pg_collection.pp.size,
                           weights_only=config.finetune or os.path.basename(folder) == "release",
                           expert_parallel=(pg_collection.ep.size > 1 if expert_folders is None
                                            else expert_folders))
        return _torch_load(path)
    if dist.get_rank() == 0:
        for note in state["notes"]:
            print(f" {note}", flush=True)
    return state


def saved_layout(folder: str, expert_parallel: bool = False) -> tuple[int, int] | None:
    """``(TP, PP)`` of the legacy checkpoint ``folder`` from its shard folders' names
    (Megatron-LM's ``mp_rank_TT[_PPP][_EEE]``), or None when it holds none.

    ``mp_rank_TT_XXX`` is ambiguous in Megatron-LM's naming (a pipeline rank, or an expert rank
    at PP = 1): it is read as the expert rank when ``expert_parallel`` (this run has EP > 1),
    else as the pipeline rank; two groups are always ``_PPP_EEE``."""
    import re

    tp = pp = 0
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = re.fullmatch(r"mp_rank_(\d{2})((?:_\d{3}){0,2})", name)
        if match and os.path.isdir(os.path.join(folder, name)):
            ranks = [int(x) for x in match.group(2).split("_")[1:]]
            if len(ranks) == 2 or expert_parallel:
                ranks = ranks[:-1]
            tp = max(tp, int(match.group(1)) + 1)
            pp = max(pp, (ranks[0] if ranks else 0) + 1)
    return (tp, pp) if tp else None


def layout_fix(load_dir: str, tp: int, pp: int, weights_only: bool = False) -> str:
    """How to load the legacy checkpoint at ``load_dir`` at TP x PP: the converter command
    (for a resume with the optimizer state, iteration and schedule carried; for
    ``weights_only``, a release of the weights) and the format that reshards itself."""
    out = f"{load_dir.rstrip('/')}_tp{tp}pp{pp}"
    then = ("then --load {out} --finetune" if weights_only else
            " --include-optimizer, then resume with --load {out} --no-load-rng").format(out=out)
    return (f"re-cut it with python tools/checkpoint/convert.py --loader megatron --saver megatron "
            f"--load-dir {load_dir} --save-dir {out} --target-tensor-parallel-size {tp} "
            f"--target-pipeline-parallel-size {pp}{', ' if weights_only else ''}{then}; save "
            "with --ckpt-format torch_dist to resume at any layout later (it reshards when loaded)")


def check_saved_layout(folder: str, load_dir: str, tp: int, pp: int,
                       weights_only: bool = False, expert_parallel: bool = False) -> None:
    """Refuse to load the legacy (``--ckpt-format torch``) checkpoint ``folder`` at a
    tensor/pipeline-parallel layout other than the one it was saved at (its shards are cut for
    that layout; every rank finds this alike, from the folder's listing).

    Raises:
        CheckpointError: naming both layouts and the fix (:func:`layout_fix`).
    """
    saved = saved_layout(folder, expert_parallel)
    if saved is None or saved == (tp, pp):
        return
    raise CheckpointError(
        f"--load {load_dir}: the checkpoint {folder} was saved with --ckpt-format torch at "
        f"--tensor-model-parallel-size {saved[0]} --pipeline-model-parallel-size {saved[1]}, but "
        f"this run has --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}, and "
        f"a torch checkpoint loads only at its own layout: run at TP={saved[0]} x PP={saved[1]}, "
        f"or {layout_fix(load_dir, tp, pp, weights_only)}")


def read_saved_args(path: str) -> dict:
    """The ``args`` of the shard ``path`` under our names: ours as saved, another system's
    translated (:func:`megatron.checkpointing.foreign.saved_args`).

    Raises:
        CheckpointError: unreadable, or a checkpoint that must be converted first.
    """
    from megatron.checkpointing import foreign as foreign_checkpoints

    foreign = foreign_checkpoints.identify(path)
    if foreign is not None:
        return foreign_checkpoints.saved_args(foreign)
    return dict(_torch_load(path).get("args") or {})


def _load_state(path, release, model_chunks, optimizer, opt_param_scheduler, config,
                pg_collection, run_flags, experts=None) -> dict:
    """Load this rank's shard ``path``; ``load_checkpoint``'s result. ``experts``: a model with
    experts' :class:`~megatron.checkpointing.legacy_experts.LegacyExpertPlan` (its experts
    assembled from the files of every saved EP rank when the layout changed)."""
    fresh = {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}
    state = _read_shard(path, config, pg_collection, run_flags,
                        None if experts is None else experts.saved_ep > 1)
    cache = {path: state}

    def read(other):
        if other not in cache:
            cache[other] = _torch_load(other)
        return cache[other]

    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        if key not in state:
            saved = (state.get("args") or {}).get("virtual_pipeline_model_parallel_size")

            def stages(v):
                return (f"--virtual-pipeline-model-parallel-size {v}" if v and v > 1
                        else "no virtual pipeline stages")

            raise CheckpointError(
                f"checkpoint {path} has no {key!r} entry: it was saved with {stages(saved)} "
                f"({_model_keys([0] * (saved or 1))}), this run has "
                f"{stages(len(model_chunks))}; load it "
                "with the virtual pipeline flags it was saved with, or re-cut it with "
                "tools/checkpoint/convert.py")
        module = unwrap_model(chunk)
        etp = pg_collection.expt_tp
        if experts is not None and expert_keys(module) and (
                experts.moved or file_expert_slice(state, pg_collection.tp.rank)
                != (etp.rank, etp.size)):
            assemble_experts(state, key, module, experts, pg_collection, read)
        check_state_dict_shapes(module.state_dict(), state[key], path)
        module.load_state_dict(state[key], strict=True)

    weights_only = release or config.finetune or state.get("weights_only_load")
    if not weights_only and not config.no_load_optim:
        if optimizer is not None and state.get("optimizer") is not None:
            check_resume_precision(state.get("args") or {}, run_flags, config.load,
                                   state.get("iteration"))
        if optimizer is not None and state.get("optimizer") is None:
            raise CheckpointError(f"checkpoint {path} holds no optimizer state (saved with "
                                  "--no-save-optim); pass --no-load-optim or --finetune")
        if optimizer is not None:
            shards = sorted(glob.glob(os.path.join(os.path.dirname(path),
                                                   distrib_optim_filename("*"))))
            if experts is not None:
                saved_etp = saved_optimizer_expert_tp(state)
                run_etp = pg_collection.expt_tp.size
                if (experts.moved or saved_etp != run_etp) and \
                        not state["optimizer"].get("distributed_optimizer"):
                    raise CheckpointError(
                        f"checkpoint {path} holds the plain optimizer's state of the experts at "
                        f"--expert-model-parallel-size {experts.saved_ep} "
                        f"--expert-tensor-parallel-size {saved_etp} (indexed by position), which "
                        "loads only at that layout; load at it, pass --no-load-optim, or save "
                        "with --use-distributed-optimizer or --ckpt-format torch_dist")
                shards = experts.shard_files
                if saved_etp != run_etp:
                    shards = resliced_shard_files(shards, model_chunks, pg_collection, saved_etp)
            _load_optimizer(optimizer, state["optimizer"], shards, model_chunks)
        if opt_param_scheduler is not None and state.get("opt_param_scheduler") is not None:
            load_scheduler_state(opt_param_scheduler, state["opt_param_scheduler"], config.load)
    elif optimizer is not None:
        # The fp32 main params were copied from the weights before the load: without optimizer
        # state they must follow the loaded weights, or the first step would restore the old ones.
        optimizer.reload_model_params()
    if not weights_only and not config.no_load_rng:
        states = state.get("rng_state")
        if not states:
            raise CheckpointError(f"checkpoint {path} holds no RNG state (saved with "
                                  "--no-save-rng); pass --no-load-rng to start new RNG streams")
        dp = pg_collection.dp
        # Megatron-LM keeps one state per DP rank; a different DP size falls back to the first.
        set_rng_state(states[dp.rank] if len(states) == dp.size else states[0])
    if weights_only:
        return fresh
    return {"iteration": state["iteration"],
            "consumed_train_samples": state.get("consumed_train_samples", 0),
            "consumed_valid_samples": state.get("consumed_valid_samples", 0)}
