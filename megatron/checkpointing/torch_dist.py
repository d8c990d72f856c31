"""Checkpoints in the distributed format (``--ckpt-format torch_dist``): saved once, loaded at any
TP / PP / virtual-stage / DP layout, with either optimizer; optionally saved in the background
(``--async-save``).

Layout (Megatron-Core's file names)::

    SAVE/latest_checkpointed_iteration.txt     "100", as for the legacy format
    SAVE/iter_0000100/metadata.json            {"sharded_backend": "torch_dist", ...}
    SAVE/iter_0000100/common.pt                plain data: iteration, consumed samples,
                                               scheduler, optimizer hyperparameters and step,
                                               loss scaler, RNG states, args, layout, versions
    SAVE/iter_0000100/.metadata                torch.distributed.checkpoint's index of the boxes
    SAVE/iter_0000100/__R_0.distcp             the boxes rank R wrote, after its save id

Every file of one save is tied to the others: each data file starts with its rank's save id,
which ``.metadata`` names, and ``common.pt`` holds rank 0's (``save_id``); a file of another
save (same iteration and layout or not) is refused naming it
(:mod:`megatron.core.dist_checkpointing.storage`). Checkpoints written before the ids load as
before, saying so once.

The tensors are global and layout-free (:mod:`megatron.core.dist_checkpointing`; names in
:mod:`megatron.model.sharded_state` and :mod:`megatron.core.optimizer.sharded_state`).
``common.pt`` is read with ``torch.load(weights_only=True)``: tensors, numbers, strings, lists and
dicts only. It is not Megatron-LM's ``torch_dist`` content (whose ``common.pt`` pickles its
``args`` and whose QKV is fused per query group): the layout and names are shared, the format is
ours.

Crash safety is the legacy format's: every rank writes into ``iter_XXXXXXX.tmp/``; only once all
have finished does rank 0 rename it and then replace the tracker atomically, so a kill at any
moment leaves the previous checkpoint loadable. ``--keep-last-checkpoints`` deletes after that.

Asynchronous saves (:class:`TorchDistSaver`): a background thread copies the boxes to host memory
while the loop runs the next forward and backward passes (the next optimizer step waits for the
copy: :meth:`TorchDistSaver.wait_for_staging`), then writes them over a gloo process group of
its own. At every
iteration boundary while a write is pending one all-reduce (MIN of "finished / running /
failed" over the world) tells every rank whether all writes have finished: then the checkpoint is
published, or, if one failed, every rank raises. The next save and the end of training wait for
the pending write.

RNG states (Megatron-LM's ``load_checkpoint``): one per (pipeline, tensor) rank and per
data-parallel rank. Loaded at the same TP and PP sizes (data-parallel size changed: every rank
takes data-parallel rank 0's, as Megatron does without ``--data-parallel-random-init``); at
other TP or PP sizes they no longer map one-to-one and are ignored, said in the log: the run's
freshly seeded streams go on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron.checkpointing import checkpoint_folder
from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError, CheckpointSaveError
from megatron.config.saved_args import check_resume_precision
from megatron.core import dist_checkpointing as dcp
from megatron.core.distributed.model_chunk import as_model_chunk
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.dist_checkpointing.async_writer import (DONE, FAILED, RUNNING, BackgroundWrite,
                                                           HostBuffers, stage_to_host)
from megatron.model import unwrap_model
from megatron.model.sharded_state import model_shardings, model_sharded_tensors
from megatron.checkpointing.rng_state import get_rng_state, set_rng_state
from megatron.usage_error import UsageError, agree_on_usage_error

FORMAT_VERSION = 1
COMMON_FILE = "common.pt"
METADATA_JSON = "metadata.json"
_BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is whole but is not what this run's flags ask for (another model shape, no
    optimizer or RNG state): the fix is in the flags, not in choosing another checkpoint."""


@dataclass(frozen=True)
class Layout:
    """This rank's place in the run's layout, as the checkpoint needs it; ``groups`` the
    process groups themselves (each parameter's tensor-parallel group and replica group: the
    sharded-state code takes them), None for a layout read back from a checkpoint."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    vp_size: Optional[int] = None
    distributed_optimizer: bool = False
    groups: Optional[ProcessGroupCollection] = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, pg_collection, optimizer=None) -> "Layout":
        """The layout of ``pg_collection`` (data-parallel: DP x CP, over which the model is
        replicated and the distributed optimizer shards); ``optimizer`` says which kind."""
        return cls(pg_collection.tp.rank, pg_collection.tp.size, pg_collection.pp.rank,
                   pg_collection.pp.size, pg_collection.dp_cp.rank, pg_collection.dp_cp.size,
                   pg_collection.virtual_pipeline_model_parallel_size,
                   optimizer is not None and optimizer.kind == "distributed", pg_collection)

    def describe(self) -> str:
        vp = f" x {self.vp_size} virtual stages" if self.vp_size else ""
        return (f"TP={self.tp_size} PP={self.pp_size}{vp} DP={self.dp_size} "
                f"({'distributed' if self.distributed_optimizer else 'plain'} optimizer)")


def is_torch_dist_checkpoint(folder: str) -> bool:
    """True when ``folder`` (an ``iter_*`` folder) holds a checkpoint of this format.

    Raises:
        CheckpointError: its ``metadata.json`` exists but is no regular file (a named pipe, a
            folder, a device): never opened, ``open`` of a pipe blocks until a writer comes; it
            is no JSON (deep nesting, bytes that are not UTF-8) or names another backend; or
            the folder holds files of both formats (:func:`_refuse_mixed_formats`).
    """
    _refuse_mixed_formats(folder)
    path = os.path.join(folder, METADATA_JSON)
    if not os.path.isfile(path):
        if os.path.lexists(path):
            raise CheckpointError(f"{path} is no regular file (a named pipe, a folder, a device or "
                                  "a broken link); it was not opened: replace it with the "
                                  "checkpoint's metadata.json")
        return False
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{path} cannot be read as JSON ({type(exc).__name__}: "
                              f"{str(exc)[:200]}): replace it with the checkpoint's metadata.json") from None
    backend = data.get("sharded_backend") if isinstance(data, dict) else None
    if backend != "torch_dist":
        raise CheckpointError(f"{path} names sharded_backend {backend!r}: only torch_dist "
                              "distributed checkpoints are read (Megatron-Core's zarr backend is "
                              "not); replace it with the checkpoint's metadata.json")
    return True


def _refuse_mixed_formats(folder: str) -> None:
    """Refuse a checkpoint folder holding legacy shards (``mp_rank_*``) beside this format's
    files: two saves' files copied into one folder. Loading either part would silently drop
    the other, and which one the user meant is not ours to guess.

    Raises:
        CheckpointError: naming the folder, one file of each format and the fix.
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return  # no folder: the caller names what is missing
    ours = sorted(n for n in names if n in (METADATA_JSON, COMMON_FILE, dcp.METADATA_FILE)
                  or n.endswith(".distcp"))
    legacy_shards = sorted(n for n in names if n.startswith("mp_rank_"))
    if ours and legacy_shards:
        raise CheckpointError(
            f"{folder} holds files of two checkpoint formats: torch_dist ({', '.join(ours[:3])}) "
            f"and legacy --ckpt-format torch ({', '.join(legacy_shards[:3])}), copied from two "
            "saves; move the files of the one you do not mean out of the folder")


def looks_complete(folder: str) -> bool:
    """Every file of the checkpoint present: ``metadata.json``, ``common.pt``, DCP's
    ``.metadata`` (written last) and the data files it names, each long enough."""
    if not all(os.path.isfile(os.path.join(folder, f))
               for f in (METADATA_JSON, COMMON_FILE, dcp.METADATA_FILE)):
        return False
    try:
        metadata = dcp.read_metadata(folder)
    except dcp.CheckpointFormatError:
        return False
    ends = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return all(os.path.isfile(os.path.join(folder, f))
               and os.path.getsize(os.path.join(folder, f)) >= end for f, end in ends.items())


def checkpoint_group(timeout_minutes: Optional[float] = None):
    """A gloo group over the world for the checkpoints' own collectives (DCP's plans, RNG
    gathering; the background writer). Collective over the world."""
    timeout = timedelta(minutes=timeout_minutes) if timeout_minutes else None
    return dist.new_group(backend="gloo", **({"timeout": timeout} if timeout else {}))


# What a checkpoint holds --------------------------------------------------------------------------

def sharded_tensors(model_chunks, optimizer, layout: Layout, *, with_optimizer: bool):
    """This rank's boxes of the model (and optimizer state), each with its one writer chosen, and
    the optimizer's plain data (None without optimizer)."""
    for chunk in model_chunks:  # pending all-gathers of the distributed optimizer: new weights
        as_model_chunk(chunk).finish_param_sync()
    replicated = model_sharded_tensors(model_chunks, layout.groups)
    owned, common = [], None
    if with_optimizer:
        state = optimizer.sharded_state_dict(model_shardings(model_chunks, layout.groups))
        replicated += state.replicated
        owned, common = state.owned, state.common
    # One writer per replicated box, chosen among its own replica group (dp_cp or expt_dp).
    return dcp.balance_writers_by_group(replicated, layout.groups.rank) + owned, common


def _gather_rng(layout: Layout, group) -> Optional[dict]:
    """Every rank's RNG states on rank 0: ``{"tp", "pp", "dp", "states": [pp][tp][dp]}``."""
    mine = (layout.pp_rank, layout.tp_rank, layout.dp_rank, get_rng_state())
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    if gathered is None:
        return None
    states = [[[None] * layout.dp_size for _ in range(layout.tp_size)]
              for _ in range(layout.pp_size)]
    for p, t, d, state in gathered:
        states[p][t][d] = state
    return {"tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size, "states": states}


def common_state(iteration, optimizer_common, scheduler, run_flags: dict, layout: Layout, rng,
                 consumed_train_samples: int, consumed_valid_samples: int) -> dict:
    return {
        "format": "megatron-llama-3d torch_dist", "format_version": FORMAT_VERSION,
        "iteration": iteration, "consumed_train_samples": consumed_train_samples,
        "consumed_valid_samples": consumed_valid_samples,
        "optimizer": optimizer_common,
        "opt_param_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng_state": rng, "args": dict(run_flags),
        "true_vocab_size": run_flags.get("true_vocab_size"),
        "layout": {"tensor_model_parallel_size": layout.tp_size,
                   "pipeline_model_parallel_size": layout.pp_size,
                   "data_parallel_size": layout.dp_size,
                   "virtual_pipeline_model_parallel_size": layout.vp_size,
                   "use_distributed_optimizer": layout.distributed_optimizer},
    }


def _write_common(staging: str, common: dict) -> None:
    checkpoint_folder.write_atomic(common, os.path.join(staging, COMMON_FILE))
    tmp = os.path.join(staging, METADATA_JSON + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(dict(_BACKEND, format_version=FORMAT_VERSION), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(staging, METADATA_JSON))


# Saving ------------------------------------------------------------------------------------------

@dataclass
class _Pending:
    iteration: int
    staging: str
    final_dir: str
    write: BackgroundWrite
    handed_off_s: float


class TorchDistSaver:
    """Saves ``--ckpt-format torch_dist`` checkpoints under ``save_dir`` and publishes them; with
    ``async_save`` the writes run in the background (module docstring).

    Args:
        save_dir: ``--save``.
        group: the checkpoints' gloo group (:func:`checkpoint_group`).
        device: the training device (the all-reduces of the world run on it).
        async_save: ``--async-save``.
        keep_last: ``--keep-last-checkpoints``.
    """

    def __init__(self, save_dir: str, group, device, *, async_save: bool = False,
                 keep_last: Optional[int] = None):
        self.save_dir, self.group, self.device = save_dir, group, device
        self.async_save, self.keep_last = async_save, keep_last
        self.pending: Optional[_Pending] = None
        self.buffers = HostBuffers()
        self.last_stall_s: Optional[float] = None

    def save(self, iteration: int, model_chunks, optimizer, scheduler, config, layout: Layout, *,
             run_flags: dict, consumed_train_samples: int, consumed_valid_samples: int,
             protect=()) -> Optional[str]:
        """Save ``iteration``. Collective over the world. Waits for a pending save first.

        Args:
            config: the run's :class:`~megatron.config.CheckpointConfig` (``no_save_optim``,
                ``no_save_rng``).
            run_flags: the plain ``args`` the checkpoint records
                (:func:`megatron.config.checkpoint_args`).
            protect: folders ``--keep-last-checkpoints`` keeps when this save is published
                (:func:`megatron.checkpointing.checkpoint_folder.checkpoints_to_remove`).

        Returns:
            the published folder (synchronous), or None (asynchronous: published later by
            :meth:`finalize`).

        Raises:
            CheckpointError: on every rank when a rank failed to write; the previous checkpoint
                and the tracker stay untouched.
        """
        self.finalize(blocking=True)
        start = time.perf_counter()
        final_dir = checkpoint_folder.get_checkpoint_dir(self.save_dir, iteration)
        staging, rank = final_dir + ".tmp", dist.get_rank()
        with_optimizer = optimizer is not None and not config.no_save_optim
        boxes, optimizer_common = sharded_tensors(model_chunks, optimizer, layout,
                                                  with_optimizer=with_optimizer)
        rng = None if config.no_save_rng else _gather_rng(layout, self.group)
        common = common_state(iteration, optimizer_common, scheduler, run_flags, layout, rng,
                              consumed_train_samples, consumed_valid_samples)
        error = None
        if rank == 0:
            try:
                checkpoint_folder.prepare_staging(self.save_dir, staging)
            except CheckpointError as exc:
                error = str(exc)
            except OSError as exc:
                error = f"rank 0 could not create {staging}: {exc}"
        # Also: every rank sees the staging folder exist before writing into it.
        self._agree(error, iteration)
        if self.async_save:
            write = BackgroundWrite(lambda: stage_to_host(boxes, self.buffers),
                                    lambda staged: self._write(staged, staging, common))
            self.last_stall_s = time.perf_counter() - start
            self.pending = _Pending(iteration, staging, final_dir, write, self.last_stall_s)
            return None
        try:
            self._write(boxes, staging, common)
        except (dcp.CheckpointWriteError, OSError) as exc:
            error = str(exc)
        self._agree(error, iteration, staging)
        self._publish(iteration, staging, final_dir, protect)
        self.last_stall_s = time.perf_counter() - start
        return final_dir

    def wait_for_staging(self) -> None:
        """Call before the optimizer step that follows an asynchronous save: its host copy must
        be complete before the weights and optimizer state change (no-op otherwise)."""
        if self.pending is not None:
            self.pending.write.wait_staged()

    def _write(self, boxes, staging: str, common: dict) -> None:
        """Every rank's boxes (collective over the checkpoints' group), then rank 0's plain data:
        a failure of the latter comes after DCP's collectives, so no rank waits in them."""
        save_id = dcp.save(boxes, staging, process_group=self.group)
        if dist.get_rank() == 0:
            try:  # rank 0's save id ties common.pt to .metadata (dcp.check_save_id)
                _write_common(staging, dict(common, save_id=save_id))
            except OSError as exc:
                raise OSError(f"rank 0 could not write {os.path.join(staging, COMMON_FILE)}: "
                              f"{exc}") from None

    def _agree(self, error: Optional[str], iteration: int, staging: Optional[str] = None) -> None:
        """Collective: every rank raises ``CheckpointSaveError`` when any failed (the lowest
        failing rank's line; rank 0 removes ``staging`` first)."""
        intact = (f"; the previous checkpoint and {checkpoint_folder.TRACKER_FILENAME} are intact "
                  "(free space under --save, then restart with --load)")
        cleanup = None if staging is None else (
            lambda: dist.get_rank() == 0 and shutil.rmtree(staging, ignore_errors=True))
        checkpoint_folder.agree_on_save_error(
            None if error is None else error + intact, self.device,
            f"saving the checkpoint of iteration {iteration} failed on another rank{intact}",
            cleanup=cleanup)

    def _publish(self, iteration: int, staging: str, final_dir: str, protect=()) -> None:
        if dist.get_rank() == 0:
            checkpoint_folder.publish(self.save_dir, staging, final_dir, iteration,
                                      self.keep_last, protect=protect)
        dist.barrier()

    def finalize(self, blocking: bool, protect=()) -> Optional[str]:
        """Publish the pending asynchronous save once every rank has written its part.
        Collective over the world while a save is pending (one all-reduce); nothing otherwise.

        Args:
            blocking: wait for this rank's write first (the next save, the end of training).
            protect: folders ``--keep-last-checkpoints`` keeps when it is published.

        Returns:
            the published folder, or None (nothing pending, or still being written).

        Raises:
            CheckpointError: on every rank when a rank's write failed.
        """
        pending = self.pending
        if pending is None:
            return None
        state = pending.write.wait() if blocking else pending.write.state()
        flag = torch.tensor([state], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        agreed = int(flag.item())
        if agreed == RUNNING:
            return None
        self.pending = None
        if agreed == FAILED:
            pending.write.wait()
            error = pending.write.error
            self._agree(None if error is None else f"the background write of iteration "
                        f"{pending.iteration} failed: {error}", pending.iteration, pending.staging)
            if dist.get_rank() == 0:  # no rank kept a reason (the writer's state alone failed)
                shutil.rmtree(pending.staging, ignore_errors=True)
            raise CheckpointSaveError(
                f"the background write of iteration {pending.iteration} failed; the previous "
                "checkpoint is intact", reporter=0)
        assert agreed == DONE
        self._publish(pending.iteration, pending.staging, pending.final_dir, protect)
        return pending.final_dir


# Loading -----------------------------------------------------------------------------------------

def _refuse_megatron_lm_s(folder: str) -> None:
    """Megatron-Core writes ``metadata.json`` with its four backend keys only; ours adds
    ``format_version``. Its ``common.pt`` pickles the run's args and its tensors are laid out
    otherwise (module docstring): named as such, not as a damaged or dangerous file."""
    try:
        with open(os.path.join(folder, METADATA_JSON), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return
    if isinstance(meta, dict) and "format_version" not in meta:
        raise CheckpointMismatchError(
            f"{folder} is a torch_dist checkpoint of Megatron-LM itself (its {METADATA_JSON} has "
            "no format_version), not one of ours: --load reads its weights at any layout "
            "(megatron.checkpointing.foreign.megatron_lm_dist), tools/checkpoint/convert.py "
            "--loader megatron-lm converts it")
    # The backends' versions say how the files are laid out; a newer one is not read as ours.
    unknown = {k: meta.get(k) for k, v in _BACKEND.items() if isinstance(meta, dict)
               and k in meta and meta.get(k) != v}
    if unknown:
        raise CheckpointMismatchError(
            f"{os.path.join(folder, METADATA_JSON)} names {unknown}; this code reads "
            f"{ {k: _BACKEND[k] for k in unknown} }: load it with the version that wrote it")


def read_common(folder: str) -> dict:
    """The plain data of the checkpoint in ``folder`` (``torch.load(weights_only=True)``).

    Raises:
        CheckpointError: missing, truncated or refused; ``CheckpointMismatchError`` for
            Megatron-LM's own torch_dist checkpoint.
    """
    from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file

    _refuse_megatron_lm_s(folder)
    path = os.path.join(folder, COMMON_FILE)
    if not os.path.lexists(path):  # one that is no file: load_torch_file names what it is
        raise CheckpointError(f"{path} does not exist: {folder} is not a complete "
                                     "torch_dist checkpoint")
    common = load_torch_file(path, what="torch_dist common state")
    if not isinstance(common, dict) or common.get("format_version") is None:
        raise CheckpointError(f"{path} is not the common part of a torch_dist checkpoint")
    if type(common["format_version"]) is not int:  # a foreign file: no TypeError below
        raise CheckpointError(f"{path} has format version {common['format_version']!r}: not an "
                              "integer; it is not the common part of a torch_dist checkpoint "
                              "this code wrote")
    if common["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {common['format_version']}; this "
                                     f"code reads up to {FORMAT_VERSION}")
    _check_common_keys(common, path)
    return common


# What loading reads from common.pt without a default: {key: type}, and the layout's keys.
_COMMON_KEYS = {"iteration": int, "consumed_train_samples": int, "consumed_valid_samples": int,
                "layout": dict}
_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "data_parallel_size", "virtual_pipeline_model_parallel_size",
                "use_distributed_optimizer")
_RNG_KEYS = ("tp", "pp", "dp", "states")


@contextlib.contextmanager
def _damaged(folder: str, key: str, kind=CheckpointError):
    """Turn what a damaged part ``key`` of ``common.pt`` raises while it is applied (a missing
    inner key, a value of another type) into one ``kind`` naming the file and the key."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, StopIteration) as exc:
        if isinstance(exc, (CheckpointError, UsageError)):
            raise
        raise kind(f"{os.path.join(folder, COMMON_FILE)}: its {key} is damaged or was not written "
                   f"by this code ({type(exc).__name__}: {str(exc)[:200]}); load the last "
                   "complete checkpoint") from None


def _check_common_keys(common: dict, path: str) -> None:
    """Refuse a ``common.pt`` that lacks what loading reads (or holds it as another type), naming
    the keys, instead of a bare KeyError later.

    Raises:
        CheckpointError: naming ``path`` and the keys.
    """
    wrong = [f"{k} (missing)" if k not in common else f"{k} (a {type(common[k]).__name__})"
             for k, kind in _COMMON_KEYS.items()
             if k not in common or not isinstance(common[k], kind) or isinstance(common[k], bool)]
    if not wrong:
        wrong = [f"{k} ({common[k]}, negative)" for k, kind in _COMMON_KEYS.items()
                 if kind is int and common[k] < 0]
    if not wrong:
        wrong = [f"layout.{k} (missing)" for k in _LAYOUT_KEYS if k not in common["layout"]]
    rng = common.get("rng_state")
    if not wrong and rng is not None and not (isinstance(rng, dict)
                                              and all(k in rng for k in _RNG_KEYS)):
        wrong = [f"rng_state (without {', '.join(k for k in _RNG_KEYS if k not in rng)})"
                 if isinstance(rng, dict) else f"rng_state (a {type(rng).__name__})"]
    if wrong:
        raise CheckpointError(f"{path} is not the common part of a complete torch_dist "
                              f"checkpoint: {', '.join(wrong)}; it is damaged or was not written "
                              "by this code")


def _prefer_fp32_weights(boxes, saved: set):
    """fp32 weights come from the saved fp32 main parameters when the saving run had them."""
    out = []
    for b in boxes:
        fp32_key = "optimizer.state.fp32_param." + b.key[len("model."):]
        if b.data.dtype == torch.float32 and fp32_key in saved:
            b = b.__class__(fp32_key, b.data, b.global_shape, b.global_offset, b.replica_id,
                            b.resizable)
        out.append(b)
    return out


def _restore_rng(common: dict, layout: Layout, folder: str, notes: list) -> None:
    rng = common.get("rng_state")
    if not rng:
        raise CheckpointMismatchError(f"checkpoint {folder} holds no RNG state (saved with "
                                     "--no-save-rng); pass --no-load-rng to start new RNG streams")
    if (rng["tp"], rng["pp"]) != (layout.tp_size, layout.pp_size):
        notes.append(f"(TP, PP) mismatch after resume ({(layout.tp_size, layout.pp_size)} vs "
                     f"{(rng['tp'], rng['pp'])} from checkpoint): RNG state will be ignored "
                     "(the run's freshly seeded RNG streams continue)")
        return
    per_dp = rng["states"][layout.pp_rank][layout.tp_rank]
    if rng["dp"] != layout.dp_size:
        notes.append(f"data-parallel size {rng['dp']} -> {layout.dp_size}: every data-parallel "
                     "rank takes the RNG state of data-parallel rank 0")
    set_rng_state(per_dp[layout.dp_rank] if rng["dp"] == layout.dp_size else per_dp[0])


def _prepare(folder, model_chunks, optimizer, layout: Layout, with_optimizer: bool):
    """Read the checkpoint's plain data and index; the boxes to read (checked) and the
    optimizer's ``finish``."""
    common = read_common(folder)
    metadata = dcp.read_metadata(folder)
    notes = dcp.check_save_id(metadata, common.get("save_id"), folder, COMMON_FILE)
    shapes = dcp.tensor_shapes(metadata)
    saved = set(shapes)
    boxes = _prefer_fp32_weights(
        model_sharded_tensors(model_chunks, layout.groups), saved)
    notes += _vocabulary_notes(boxes, shapes, common, folder)
    finish = None
    if with_optimizer:
        if common.get("optimizer") is None:
            raise CheckpointMismatchError(f"checkpoint {folder} holds no optimizer state (saved "
                                         "with --no-save-optim); pass --no-load-optim or --finetune")
        targets = optimizer.sharded_load_targets(
            model_shardings(model_chunks, layout.groups), saved)
        boxes += targets.replicated + targets.owned
        finish = targets.finish
    try:
        boxes = dcp.check_fits(boxes, metadata, folder)
    except dcp.CheckpointFormatError as exc:
        raise CheckpointMismatchError(str(exc)) from None
    return common, metadata, boxes, finish, notes


def _vocabulary_notes(boxes, shapes: dict, common: dict, folder: str) -> list:
    """The vocabulary is padded per TP size (``--make-vocab-size-divisible-by`` x TP): another
    padding loads the rows both have, which must hold the true vocabulary.

    Raises:
        CheckpointError: fewer rows on one side than the true vocabulary.
    """
    notes, seen = [], set()
    true = common.get("true_vocab_size")
    for b in boxes:
        rows = shapes.get(b.key, ((None,),))[0][0]
        if not b.resizable or b.key in seen or rows in (None, b.global_shape[0]):
            continue
        seen.add(b.key)
        if true is not None and min(rows, b.global_shape[0]) < true:
            raise CheckpointMismatchError(
                f"{folder}: {b.key} has {rows} vocabulary rows, this run {b.global_shape[0]}, "
                f"fewer than the true vocabulary ({true}); check the tokenizer flags")
        notes.append(f"{b.key}: {rows} padded vocabulary rows saved, {b.global_shape[0]} in this "
                     f"run (--make-vocab-size-divisible-by x TP); the first "
                     f"{min(rows, b.global_shape[0])} are loaded, further padding rows keep their "
                     "initial values")
    return notes


def load_checkpoint(folder: str, model_chunks, optimizer, scheduler, config, layout: Layout,
                    group, run_flags: Optional[dict] = None, explain=None) -> dict:
    """Load the torch_dist checkpoint ``folder`` at this run's layout. Collective over the world.

    ``--finetune`` loads the weights only (iteration 0); ``--no-load-optim`` / ``--no-load-rng``
    skip those parts. Without optimizer state loaded, the optimizer's fp32 main parameters are
    refreshed from the loaded weights.

    Returns:
        dict with ``iteration``, ``consumed_train_samples``, ``consumed_valid_samples``.

    Args:
        run_flags: this run's plain flags; with them an optimizer state saved in another
            precision is refused (:func:`megatron.config.saved_args.check_resume_precision`).
        explain: ``str -> str``, the message of a damaged or missing file with what to fall back
            on (not for a :class:`CheckpointMismatchError`, which is the flags' to fix).

    Raises:
        CheckpointError: on every rank, naming the file or tensor, if any rank cannot load.
        UsageError: on every rank alike (all read the same common file), a resume in another
            precision.
    """
    weights_only = config.finetune
    with_optimizer = optimizer is not None and not weights_only and not config.no_load_optim
    device = next(unwrap_model(model_chunks[0]).parameters()).device
    error, prepared = None, None
    for chunk in model_chunks:  # ZeRO-3: DCP reads into the full (gathered) parameters
        as_model_chunk(chunk).finish_param_sync()
    try:
        prepared = _prepare(folder, model_chunks, optimizer, layout, with_optimizer)
    except (CheckpointError, dcp.CheckpointFormatError, ValueError) as exc:
        error = exc if isinstance(exc, CheckpointError) else CheckpointError(str(exc))
    if explain is not None and error is not None and not isinstance(error, CheckpointMismatchError):
        error = CheckpointError(explain(str(error)))
    # Before DCP's collectives, so that no rank waits in them for one that failed; said once.
    checkpoint_folder.agree_on_load_error(error, device, folder)
    common, metadata, boxes, finish, notes = prepared
    # Every rank finds these alike; agreed (one rank prints, a barrier, then all leave) so that
    # torchrun does not stop rank 0 before its line is out when another rank exits first.
    usage = None
    try:
        if with_optimizer and run_flags is not None and common.get("optimizer") is not None:
            check_resume_precision(common.get("args") or {}, run_flags, config.load,
                                   common["iteration"])
        if not weights_only and scheduler is not None and not config.no_load_optim \
                and common.get("opt_param_scheduler") is not None:
            with _damaged(folder, "opt_param_scheduler", UsageError):
                checkpoint_folder.load_scheduler_state(scheduler, common["opt_param_scheduler"],
                                                       config.load)
    except UsageError as exc:
        usage = exc
    agree_on_usage_error(usage, device)
    try:
        dcp.load(boxes, folder, process_group=group, metadata=metadata)
    except dcp.CheckpointFormatError as exc:
        raise CheckpointError(str(exc)) from None
    for chunk in model_chunks:  # ZeRO-3: the loaded weights into the shards, the rest freed
        as_model_chunk(chunk).reshard_params()
    if finish is not None:  # every rank reads the same common.pt: all raise alike
        with _damaged(folder, "optimizer"):
            finish(common["optimizer"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    if not weights_only and not config.no_load_rng:
        with _damaged(folder, "rng_state"):
            _restore_rng(common, layout, folder, notes)
    if dist.get_rank() == 0:
        saved = common["layout"]
        then = Layout(tp_size=saved["tensor_model_parallel_size"],
                      pp_size=saved["pipeline_model_parallel_size"],
                      dp_size=saved["data_parallel_size"],
                      vp_size=saved["virtual_pipeline_model_parallel_size"],
                      distributed_optimizer=saved["use_distributed_optimizer"])
        print(f" loaded torch_dist checkpoint {folder} (iteration {common['iteration']}), saved at "
              f"{then.describe()}, into {layout.describe()}", flush=True)
        for note in notes:
            print(f" {note}", flush=True)
    if weights_only:
        return {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}
    return {k: common[k] for k in ("iteration", "consumed_train_samples",
                                   "consumed_valid_samples")}


def read_tensors(folder: str, prefix: str = "model.") -> dict:
    """The whole global tensors whose keys start with ``prefix`` (the weights by default), read
    in this process alone (tools; no collective): ``{key without prefix: tensor}``.

    Raises:
        CheckpointError: the folder is not a complete, readable torch_dist checkpoint.
    """
    try:
        metadata = dcp.read_metadata(folder)
        shapes = dcp.tensor_shapes(metadata)
        boxes = [dcp.ShardedTensor(k, torch.empty(shape, dtype=dtype), shape, (0,) * len(shape))
                 for k, (shape, dtype) in sorted(shapes.items()) if k.startswith(prefix)]
        dcp.load(boxes, folder, metadata=metadata, single_process=True)
    except dcp.CheckpointFormatError as exc:
        raise CheckpointError(str(exc)) from None
    return {b.key[len(prefix):]: b.data for b in boxes}
