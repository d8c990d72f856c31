"""The ``--save`` folder: usable before training starts, and written by one job at a time.

Two jobs saving into one folder overwrite each other's checkpoints, and each one's clean-up
(leftover ``iter_*.tmp`` / ``iter_*.old`` folders, ``--keep-last-checkpoints``) deletes the
other's files. So a training job holds a lock file, ``SAVE/megatron_save.lock``, from before the
model is built to its end, written by global rank 0:

* it holds JSON: ``host``, ``pid``, the process's start time (Linux ``/proc``: a pid reused by
  another process is not mistaken for the holder), ``job`` (``slurm:$SLURM_JOB_ID`` or
  ``torchrun:$TORCHELASTIC_RUN_ID``, empty outside a launcher and for torchrun's default run
  id ``none``), ``started`` (UTC) and a random ``token``;
* it is created atomically (written under a temporary name, then hard-linked to the lock's name,
  which fails if it exists; ``O_EXCL`` where the file system has no hard links);
* a lock whose holder is gone is taken over, saying so: on this host, a holder process that has
  ended; on any host, the holder is an earlier attempt of this very job (an elastic restart may
  start rank 0 on another node). A live holder on this host, or a holder of another job on
  another host (whose processes cannot be seen from here), is respected: the run stops with one
  line naming the folder and the holder; for another host it says how to remove a lock left by a
  job that is gone;
* every save checks that the lock is still this job's before it touches the folder
  (:func:`check_not_held_by_another_job`), so a job whose lock was removed by hand while it ran
  stops instead of deleting the new holder's files.

Before the lock, :func:`check_save_folder` refuses a ``--save`` that is a file, cannot be created
or written, or has less free space than one checkpoint of the run (an estimate from the model's
size, :func:`checkpoint_bytes`).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import stat
import shutil
import socket
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
from megatron.file_kinds import KINDS, file_kind  # noqa: F401 - file_kind: used by callers too
from megatron.usage_error import UsageError

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"  # Megatron's name of the tracker file

LOCK_FILENAME = "megatron_save.lock"
# A lock this program writes is ~200 bytes of JSON; a larger file is refused unread, so that a
# multi-gigabyte file in its place (sparse, or a log written there) is never read into memory.
LOCK_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class LockHolder:
    """Who holds a ``--save`` folder (the lock file's content)."""

    host: str
    pid: int
    job: str
    started: str
    token: str
    process_start: Optional[str] = None

    @classmethod
    def this_process(cls) -> "LockHolder":
        return cls(host=socket.gethostname(), pid=os.getpid(), job=job_id(),
                   started=datetime.datetime.now(datetime.timezone.utc).strftime(
                       "%Y-%m-%d %H:%M:%S UTC"),
                   token=uuid.uuid4().hex, process_start=_process_start(os.getpid()))

    def describe(self) -> str:
        job = f", job {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}{job}, started {self.started}"

    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()


def job_id() -> str:
    """The launcher's id of this job: Slurm's job id, else torchrun's run id (its rendezvous id,
    kept across elastic restarts), else empty. torchrun's default ``--rdzv-id`` ("none", every
    job launched without one has it) names no job: two such jobs on two hosts would otherwise
    take each other's lock as an earlier attempt of their own."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}"
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun:{os.environ['TORCHELASTIC_RUN_ID']}"
    return ""


def _process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field
    22), or None where there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive_here(holder: LockHolder) -> bool:
    """Whether the holder, a process of this host, still runs (and is the same process)."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    start = _process_start(holder.pid)
    return holder.process_start is None or start is None or start == holder.process_start


def lock_path(save_dir: str) -> str:
    return os.path.join(save_dir, LOCK_FILENAME)


def read_holder(save_dir: str) -> Optional[LockHolder]:
    """The holder named by the lock file of ``save_dir``; None without one.

    Raises:
        UsageError: the lock file exists but is not one of ours (names it and how to remove it).
    """
    path = lock_path(save_dir)
    _check_regular(save_dir, path)
    try:
        # O_NONBLOCK|O_NOFOLLOW: a pipe or link put there after the check neither blocks nor
        # leads elsewhere; fstat confirms what was opened.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, encoding="utf-8") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("it is no regular file")
            if info.st_size > LOCK_MAX_BYTES:
                raise ValueError(f"it holds {info.st_size:,} bytes, a lock holds at most "
                                 f"{LOCK_MAX_BYTES:,}")
            data = json.loads(f.read(LOCK_MAX_BYTES + 1))
        holder = LockHolder(**{k: data[k] for k in ("host", "pid", "job", "started", "token")},
                            process_start=data.get("process_start"))
        # A hand-edited pid ("123", 1.5, true) must not reach os.kill, nor pass for pid 1.
        if type(holder.pid) is not int or not 0 < holder.pid < 2 ** 31:
            raise ValueError(f"pid {holder.pid!r} is no process id")
        return holder
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        # RecursionError: JSON nested deeper than the parser goes (60000 '[' fit in the cap).
        if isinstance(exc, RecursionError):
            exc = "JSON nested too deep"
        raise UsageError(f"--save ({save_dir}): the lock file {path} names no job ({exc}); if no "
                         f"job uses {save_dir}, delete {path} and start again") from None


def check_tracker_files(save_dir: str) -> None:
    """Refuse a ``--save`` whose tracker (``latest_checkpointed_iteration.txt``) or the tracker's
    temporary (``.tmp``) exists and is no regular file, before anything is trained: the first
    save would die in ``os.replace`` on a folder, or wait forever opening a named pipe.

    Raises:
        UsageError: naming the file, what it is and the fix.
    """
    tracker = os.path.join(save_dir, TRACKER_FILENAME)
    for path, follow in ((tracker, True), (tracker + ".tmp", False)):
        # The tracker may be a link to a file (publish replaces the link); its temporary is
        # opened without following links, so a link there is refused too.
        if os.path.lexists(path) and not (os.path.isfile(path) if follow else
                                          stat.S_ISREG(os.lstat(path).st_mode)):
            raise UsageError(f"--save ({save_dir}): {path} is a {file_kind(path)}, not the "
                             "tracker file checkpoints are published with; remove it (or give "
                             "another --save) and start again")


def _check_regular(save_dir: str, path: str) -> None:
    """Refuse a lock path that exists and is no regular file, looking at it with ``lstat`` only
    (reading a named pipe would wait for a writer forever).

    Raises:
        UsageError: naming the file, what it is and how to remove it.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in KINDS if test(mode)), "special file")
    raise UsageError(f"--save ({save_dir}): the lock file {path} is a {kind}, not a lock file "
                     f"this program wrote; if no job uses {save_dir}, remove {path} and start "
                     "again")


def _create(path: str, holder: LockHolder) -> None:
    """Create ``path`` holding ``holder`` if it does not exist, atomically.

    Raises:
        FileExistsError: it exists.
        OSError: the folder cannot be written (permissions, full disk).
    """
    # A name no one can plant beforehand (pids repeat across containers), created exclusively
    # and never through a link: a pipe there would block open(), a link would be written through.
    tmp = f"{path}.new.{holder.host}.{holder.pid}.{uuid.uuid4().hex[:12]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(asdict(holder), f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # atomic, fails if path exists; the content is complete before
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(holder), f)
    finally:
        os.unlink(tmp)


def _takeover_reason(holder: LockHolder, me: LockHolder) -> Optional[str]:
    """Why the lock of ``holder`` may be taken over by ``me``, or None if it must be respected."""
    if holder.host == me.host:
        if holder.is_this_process():
            return "it is this process's own"
        if not _alive_here(holder):
            return f"process {holder.pid} on this host has ended"
        return None
    if holder.job and holder.job == me.job:
        return f"it is an earlier attempt of this job ({me.job}) on host {holder.host}"
    return None


def _busy(save_dir: str, holder: LockHolder) -> UsageError:
    path = lock_path(save_dir)
    gone = ("" if holder.host == socket.gethostname() else
            f"; that job runs on another host, which cannot be checked from here: if it is no "
            f"longer running, delete {path} and start again")
    return UsageError(f"--save ({save_dir}) is in use by another job ({holder.describe()}; lock "
                      f"file {path}): two jobs saving into one folder overwrite and delete each "
                      f"other's checkpoints; wait for it to end or give this run another --save "
                      f"folder{gone}")


class SaveFolderLock:
    """This job's hold on a ``--save`` folder (global rank 0 takes it)."""

    def __init__(self, save_dir: str, created: bool = False):
        self.save_dir = save_dir
        self.created = created  # made by this job: removed at release if it stayed empty
        self.holder: Optional[LockHolder] = None

    def acquire(self) -> list:
        """Take the lock; returns the notes to log (a lock taken over, and why).

        Raises:
            UsageError: another live job holds it, or the folder cannot be written.
        """
        me, notes, path = LockHolder.this_process(), [], lock_path(self.save_dir)
        for _ in range(5):  # each retry follows a change made by another job meanwhile
            try:
                _create(path, me)
                self.holder = me
                return notes
            except FileExistsError:
                pass
            except OSError as exc:
                raise UsageError(f"--save ({self.save_dir}) is not writable: creating {path} "
                                 f"failed ({exc.strerror or exc}); give a folder this job can "
                                 "write") from None
            holder = read_holder(self.save_dir)
            if holder is None:
                continue  # released meanwhile
            reason = _takeover_reason(holder, me)
            if reason is None:
                raise _busy(self.save_dir, holder)
            if _remove_if_still(path, holder, me) and not holder.is_this_process():
                notes.append(f"--save {self.save_dir}: took over the lock of {holder.describe()}"
                             f": {reason}")
        raise UsageError(f"--save ({self.save_dir}): the lock file {path} kept changing while "
                         "this job tried to take it (another job is starting on this folder); "
                         "give each job its own --save folder")

    def release(self) -> None:
        """Remove the lock file if it is still this job's (a lock taken over by another job is
        left to it), and the folder if this job created it and wrote nothing there."""
        if self.holder is None:
            return
        try:
            current = read_holder(self.save_dir)
        except UsageError:
            current = None
        if current is not None and current.token == self.holder.token:
            try:
                os.unlink(lock_path(self.save_dir))
            except FileNotFoundError:
                pass
            if self.created:
                try:
                    os.rmdir(self.save_dir)  # only an empty folder: never a file of anyone's
                except OSError:
                    pass
        self.holder = None


def _remove_if_still(path: str, holder: LockHolder, me: LockHolder) -> bool:
    """Remove the lock file if it still names ``holder``: it is moved aside first, under a name
    of this process, and put back if another job replaced it in between. Returns whether it was
    removed."""
    aside = f"{path}.stale.{me.host}.{me.pid}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        with open(aside, encoding="utf-8") as f:
            token = json.load(f).get("token")
    except (OSError, ValueError, AttributeError, RecursionError):
        token = None
    if token != holder.token:  # a new holder's lock: give it back
        try:
            os.link(aside, path)
        except OSError:
            pass
        os.unlink(aside)
        return False
    os.unlink(aside)
    return True


def check_not_held_by_another_job(save_dir: str) -> None:
    """Called by a save before it writes or deletes anything under ``save_dir``.

    Raises:
        CheckpointError: the lock file names another process (this job's lock was removed and
            another job took the folder): nothing is written, nothing deleted.
    """
    try:
        holder = read_holder(save_dir)
    except UsageError as exc:
        raise CheckpointError(str(exc)) from None
    if holder is not None and not holder.is_this_process():
        raise CheckpointError(
            f"--save {save_dir} is now held by another job ({holder.describe()}; lock file "
            f"{lock_path(save_dir)}): this job's lock was removed while it ran; it saves nothing "
            "there and deletes nothing; restart it with its own --save folder")


def checkpoint_bytes(config) -> int:
    """An estimate of one checkpoint's size in bytes for a run's
    :class:`~megatron.config.Config`: every parameter in the model's dtype, plus AdamW's state
    (two fp32 moments, and fp32 main parameters for bf16/fp16) unless ``--no-save-optim``;
    :func:`megatron.planner.memory.optimizer_state_bytes`' accounting."""
    import torch

    from megatron.planner.memory import optimizer_state_bytes, param_numels

    numels = param_numels(config.model, tp=1)
    dtype = config.model.params_dtype
    size = sum(numels) * torch.empty((), dtype=dtype).element_size()
    if not config.checkpoint.no_save_optim:
        size += optimizer_state_bytes(numels, mixed_precision=dtype != torch.float32)
    return size


def check_load_folder(load_dir: str, save_dir: Optional[str], checked_later: bool = False) -> None:
    """Refuse a ``--load`` that names no folder (missing, or a file) unless it is the ``--save``
    folder: "resume if there is something" (``--load`` = ``--save``) starts from scratch on a
    first run, but a mistyped path would silently train from scratch too.

    ``checked_later``: the run needs a checkpoint and says so itself, naming the fix more
    precisely (``--finetune``: "--finetune needs a checkpoint"; a resuming DPO run: its
    reference table, :mod:`megatron.training.dpo`): a folder without a tracker that is not the
    ``--save`` folder is left to that check.

    Raises:
        UsageError: naming the path, what it is and the fix.
    """
    same = save_dir is not None and os.path.realpath(load_dir) == os.path.realpath(save_dir)
    if os.path.isdir(load_dir):
        if not os.path.lexists(os.path.join(load_dir, TRACKER_FILENAME)):
            _check_folder_without_tracker(load_dir, same or checked_later)
        return
    if os.path.lexists(load_dir):
        what = ("a symbolic link to nothing" if not os.path.exists(load_dir) else
                "a file, not a checkpoint folder")
        raise UsageError(f"--load ({load_dir}) is {what}: give the folder that holds "
                         "latest_checkpointed_iteration.txt (the --save folder of the run to "
                         "resume)")
    if not same:
        raise UsageError(f"--load ({load_dir}) does not exist: check the path (the --save folder "
                         "of the run to resume), drop --load to start from scratch, or give "
                         "--load the --save folder to resume whenever it holds a checkpoint")


_ITERATION_FOLDER = re.compile(r"iter_\d{7}")
# What only one checkpoint's own folder holds (legacy shards, torch_dist's files).
_CHECKPOINT_MARKS = re.compile(r"mp_rank_\d\d.*|common\.pt|\.metadata|__\d+_\d+\.distcp")


def _check_folder_without_tracker(load_dir: str, same: bool) -> None:
    """A ``--load`` folder without the tracker starts from scratch only when it is the
    ``--save`` folder and holds no checkpoint: else the path was mistyped (one iteration's
    folder, another job's folder) or the tracker was lost, and a fresh run would overwrite the
    checkpoints it holds.

    Raises:
        UsageError: naming the folder, what it holds and the fix.
    """
    try:
        entries = sorted(os.listdir(load_dir))
    except OSError as exc:
        raise UsageError(f"--load ({load_dir}) cannot be read ({exc.strerror}): give a folder "
                         "this job may read") from None
    iterations = [e for e in entries if _ITERATION_FOLDER.fullmatch(e)]
    if iterations:
        last = int(iterations[-1][len("iter_"):])
        listed = ", ".join(iterations[:3]) + (", ..." if len(iterations) > 3 else "")
        raise UsageError(
            f"--load ({load_dir}) holds {listed} but no {TRACKER_FILENAME}, so nothing says "
            f"which to resume (and a fresh run would overwrite them): if {iterations[-1]} is "
            f"complete, write its iteration into the tracker (echo {last} > "
            f"{os.path.join(load_dir, TRACKER_FILENAME)}); or give --load and --save another folder")
    base = os.path.basename(os.path.normpath(load_dir))
    marks = [e for e in entries if _CHECKPOINT_MARKS.fullmatch(e)]
    if _ITERATION_FOLDER.fullmatch(base) or base == "release" or marks:
        parent = os.path.dirname(os.path.abspath(os.path.normpath(load_dir)))
        holds = f" (it holds {marks[0]})" if marks else ""
        raise UsageError(
            f"--load ({load_dir}) is one checkpoint's own folder{holds}: give --load the folder "
            f"above it, {parent}, the one that holds {TRACKER_FILENAME}")
    if not same:
        what = "is empty" if not entries else f"holds no checkpoint ({', '.join(entries[:3])}" + \
            (", ...)" if len(entries) > 3 else ")")
        hf = " (a HuggingFace model: convert it first with tools/checkpoint/convert.py " \
             "--loader hf --saver megatron)" if "config.json" in entries else ""
        raise UsageError(
            f"--load ({load_dir}) {what}{hf}: it has no {TRACKER_FILENAME} and is not the --save "
            "folder; give the --save folder of the run to resume, drop --load to start from "
            "scratch, or give --load the --save folder to resume whenever it holds a checkpoint")


def check_save_folder(save_dir: str, needed_bytes: int) -> bool:
    """Refuse a ``--save`` that cannot take checkpoints, creating it if missing.

    Returns:
        whether the folder was created here.

    Raises:
        UsageError: ``save_dir`` is a file or a symbolic link to nothing, cannot be created, is
            not writable, has less free space than ``needed_bytes`` (one checkpoint), or holds a
            tracker (or its temporary) that is no regular file (:func:`check_tracker_files`).
    """
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise UsageError(f"--save ({save_dir}) is a file, not a folder: give a folder for the "
                         "checkpoints (it is created if missing)")
    if os.path.islink(save_dir) and not os.path.exists(save_dir):  # makedirs: "File exists"
        raise UsageError(f"--save ({save_dir}) is a symbolic link to "
                         f"{os.path.realpath(save_dir)}, which does not exist: create that "
                         "folder, or give --save a folder")
    created = not os.path.isdir(save_dir)
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--save ({save_dir}) cannot be created ({exc.strerror or exc}): give a "
                         "folder this job can write") from None
    check_tracker_files(save_dir)  # it existed: nothing to remove
    error = None
    if not os.access(save_dir, os.W_OK | os.X_OK):
        error = (f"--save ({save_dir}) is not writable by this job: give a folder it can write, "
                 "or change the folder's permissions")
    else:
        free = shutil.disk_usage(save_dir).free
        if free < needed_bytes:
            error = (f"--save ({save_dir}) has {free / 1e9:.3g} GB free, less than one checkpoint "
                     f"of this run (about {needed_bytes / 1e9:.3g} GB): free space there or give "
                     "a folder on a larger disk")
    if error is not None:
        if created:
            os.rmdir(save_dir)
        raise UsageError(error)
    return created


def save_target(checkpoint) -> Optional[str]:
    """The folder a run writes checkpoints into (a :class:`~megatron.config.CheckpointConfig`):
    ``--ckpt-convert-save DIR`` / ``--ckpt-convert-format F`` writes ``DIR/F`` (and trains not),
    else ``--save``."""
    if checkpoint.ckpt_convert_format:
        return os.path.join(checkpoint.ckpt_convert_save, checkpoint.ckpt_convert_format)
    return checkpoint.save


def hold_save_folder(config, device) -> Optional[SaveFolderLock]:
    """Check ``--save`` (or the conversion target, :func:`save_target`) and take its lock, before
    the model is built. Collective over the world.

    Global rank 0 checks the folder (:func:`check_save_folder`, against :func:`checkpoint_bytes`)
    and takes the lock; then the first rank of every node (``LOCAL_RANK`` 0) checks it sees that
    lock, so a ``--save`` on a node's local disk is refused instead of scattering the shards.

    Args:
        config: the run's :class:`~megatron.config.Config`.
        device: the collective backend's device.

    Returns:
        the lock on global rank 0 (release it when the run ends), None on the other ranks and
        without ``--save``.

    Raises:
        UsageError: on every rank, said once (:func:`megatron.usage_error.agree_on_usage_error`).
    """
    import torch.distributed as dist

    from megatron.usage_error import agree_on_usage_error

    save = save_target(config.checkpoint)
    if not save:
        return None
    rank, lock, error, notes = dist.get_rank(), None, None, []
    if rank == 0:
        try:
            lock = SaveFolderLock(save, created=check_save_folder(save, checkpoint_bytes(config)))
            notes = lock.acquire()
        except UsageError as exc:
            error = exc
        except OSError as exc:  # e.g. disk_usage or a rename refused: the others must not wait
            error = UsageError(f"--save ({save}): {exc.strerror or exc}"
                               f"{f' ({exc.filename})' if exc.filename else ''}: give a folder "
                               "this job can read and write")
    agree_on_usage_error(error, device)
    token = [lock.holder.token if lock is not None else None]
    dist.broadcast_object_list(token, src=0)
    error = None
    if rank != 0 and os.environ.get("LOCAL_RANK", "0") == "0":
        try:
            seen = read_holder(save)
        except UsageError:
            seen = None
        if seen is None or seen.token != token[0]:
            error = UsageError(f"--save ({save}): host {socket.gethostname()} (rank {rank}) does "
                               "not see the lock file rank 0 wrote there: --save must be a folder "
                               "every node shares (a shared file system)")
    try:
        agree_on_usage_error(error, device)
    except UsageError:
        if lock is not None:
            lock.release()
        raise
    for note in notes:
        print(f" {note}", flush=True)
    return lock
