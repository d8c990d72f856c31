"""The checkpoint folder both formats share (Megatron-LM's conventions): the tracker file
``latest_checkpointed_iteration.txt``, ``iter_XXXXXXX/`` and ``release/`` folders, staging in
``iter_XXXXXXX.tmp/`` and publishing by rename then tracker replacement,
``--keep-last-checkpoints``.

Both :mod:`megatron.checkpointing.legacy` (``--ckpt-format torch``) and
:mod:`megatron.checkpointing.torch_dist` (``torch_dist``) build on this module, which imports
neither of them.
"""

from __future__ import annotations

import glob
import os
import shutil
import stat

import torch
import torch.distributed as dist

from megatron.checkpointing import save_folder
from megatron.core.dist_checkpointing.checkpoint_io import (CheckpointError, CheckpointSaveError,
                                                          CheckpointUsageError, save_to_file)
from megatron.core.optimizer.lr_scheduler import ScheduleMismatchError
from megatron.usage_error import UsageError

TRACKER_FILENAME = save_folder.TRACKER_FILENAME


def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def get_checkpoint_dir(checkpoints_path: str, iteration: int, release: bool = False) -> str:
    return os.path.join(checkpoints_path, "release" if release else f"iter_{iteration:07d}")


def read_metadata(tracker_filename: str) -> tuple[int, bool]:
    """Parse the tracker file: ``(iteration, release)``.

    Raises:
        CheckpointError: if the file holds neither an integer nor ``release`` (bytes that are
            not text included), naming the file.
    """
    with open(tracker_filename, "rb") as f:
        raw = f.read(4096)
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{tracker_filename} must hold an iteration number or 'release', "
                              f"found bytes that are not text ({raw[:16]!r}...)") from None
    if text == "release":
        return 0, True
    if not (text.isascii() and text.isdigit()) or len(text) > 18:  # "-2", "2.0", 5000 digits: no iter_ folder fits
        raise CheckpointError(f"{tracker_filename} must hold an iteration number or 'release', "
                              f"found {text[:40]!r}{'...' if len(text) > 40 else ''}")
    return int(text), False


_file_kind = save_folder.file_kind  # the lock file's kinds, the same words


def find_checkpoint(load_dir: str) -> tuple[int, bool] | None:
    """``(iteration, release)`` named by the tracker file of ``load_dir``, or None if absent.

    Raises:
        CheckpointError: the tracker exists but is no regular file (a named pipe, a folder, a
            broken link: never opened, a pipe would block), or does not name an iteration.
    """
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        if not os.path.lexists(tracker):
            return None
        # Not "absent": a run would silently train from scratch beside the checkpoints.
        raise CheckpointError(f"{tracker} is a {_file_kind(tracker)}, not a tracker file")
    return read_metadata(tracker)


def complete_checkpoints(checkpoints_path: str) -> list[str]:
    """Finished checkpoint folders under ``checkpoints_path`` (``iter_*`` without ``.tmp``), oldest
    first."""
    dirs = [d for d in glob.glob(os.path.join(checkpoints_path, "iter_*"))
            if os.path.isdir(d) and not d.endswith((".tmp", ".old"))]
    return sorted(dirs)


def checkpoint_iteration(folder: str) -> int | None:
    """The iteration of a checkpoint folder ``.../iter_0000100`` (None for other names)."""
    name = os.path.basename(os.path.normpath(folder))
    digits = name[len("iter_"):]
    return int(digits) if name.startswith("iter_") and digits.isdigit() else None


def checkpoints_to_remove(save_dir: str, keep_last: int, final_dir: str, protect=()) -> list:
    """The folders ``--keep-last-checkpoints keep_last`` deletes after ``final_dir`` is published:
    the complete checkpoints of earlier iterations beyond the ``keep_last - 1`` newest of them,
    except those in ``protect``. Checkpoints of later iterations than ``final_dir`` (a run resumed
    from an older checkpoint left them) are neither counted nor deleted."""
    if not keep_last:
        return []
    new = checkpoint_iteration(final_dir)
    older = [d for d in complete_checkpoints(save_dir)
             if (checkpoint_iteration(d) or 0) < new]
    kept = {os.path.abspath(p) for p in protect if p}
    surplus = older[:max(len(older) - (keep_last - 1), 0)]
    return [d for d in surplus if os.path.abspath(d) not in kept]


def load_scheduler_state(scheduler, state: dict, load_dir: str) -> None:
    """``scheduler.load_state_dict(state)``, a schedule that differs from the flags' being a
    usage error (every rank reads the same state and raises alike).

    Raises:
        UsageError: :class:`~megatron.core.optimizer.lr_scheduler.ScheduleMismatchError`, with
            ``--load`` named.
    """
    try:
        scheduler.load_state_dict(state)
    except ScheduleMismatchError as exc:
        raise UsageError(f"--load ({load_dir}): {exc}") from None


def write_atomic(obj, path: str) -> None:
    """``torch.save`` to ``path.tmp``, flushed and fsynced, then renamed over ``path``.

    Raises:
        OSError: a write failed (a full disk, a file-size limit: ``[Errno 28] No space left on
            device: 'PATH'``, :func:`megatron.core.dist_checkpointing.checkpoint_io.save_to_file`); ``path.tmp`` is
            removed.
    """
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            save_to_file(obj, f, path)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        try:  # the partial file holds space the user is about to free
            os.remove(tmp)
        except OSError:
            pass
        raise
    os.replace(tmp, path)


def all_ranks_ok(ok: bool, device) -> bool:
    """True when ``ok`` on every rank of the default group (one MIN all-reduce on ``device``)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def agree_on_save_error(error, device, otherwise: str, cleanup=None) -> None:
    """Collective over the world after each rank tried its part of a save: when any rank has an
    ``error`` (its line), every rank raises :class:`CheckpointSaveError` with the lowest failing
    rank as the reporter, the one that prints (one MIN all-reduce of an int64 elects it), after
    ``cleanup`` (rank 0 removes the staging folder). Each failing rank's error keeps its own line,
    the others' name the reporter. Nothing happens when no rank failed.

    Args:
        error: this rank's line, or None.
        otherwise: the message of the ranks that are not the reporter.
        cleanup: called on every rank before raising (None: nothing to undo).

    Raises:
        CheckpointSaveError: on every rank when any rank failed.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    elected = torch.tensor([rank if error is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(elected, op=dist.ReduceOp.MIN)
    reporter = int(elected.item())
    if reporter == world:
        return
    if cleanup is not None:
        cleanup()
    raise CheckpointSaveError(error if error is not None else f"{otherwise} (rank {reporter} says "
                              "why)", reporter=reporter)


def agree_on_load_error(error, device, what: str) -> None:
    """Collective over the world after each rank tried its part of a checkpoint load: a
    :class:`CheckpointError` (a missing, damaged, refused or misfitting file; a layout or model
    that does not fit) or :class:`UsageError` on any rank becomes the one agreed usage line
    (:func:`megatron.usage_error.agree_on_usage_error`: the lowest rank that found one prints,
    every rank raises); any other error on any rank stops every rank (this rank's own error, a
    crash with its traceback, or a :class:`CheckpointError` naming ``what``).

    Args:
        error: this rank's exception, or None.
        what: the checkpoint, for the other ranks' message (its folder).
    """
    from megatron.usage_error import agree_on_usage_error

    usage = error if isinstance(error, UsageError) else (
        CheckpointUsageError(str(error)) if isinstance(error, CheckpointError) else None)
    agree_on_usage_error(usage, device, kind=CheckpointUsageError)
    if not all_ranks_ok(error is None, device):
        raise error or CheckpointError(f"loading the checkpoint {what} failed on another rank "
                                       "(see its error)")


def prepare_staging(save_dir: str, staging: str) -> None:
    """Rank 0, before a save of either format writes anything: check that ``save_dir`` is still
    this job's (:func:`megatron.checkpointing.save_folder.check_not_held_by_another_job`), remove ``staging``
    (the leftover of a save of this iteration killed earlier) and create it afresh.

    Raises:
        CheckpointError: another job holds the folder now; nothing is touched.
        OSError: ``staging`` cannot be created.
    """
    save_folder.check_not_held_by_another_job(save_dir)
    remove_path(staging)
    os.makedirs(staging, exist_ok=True)


def remove_path(path: str) -> None:
    """Remove what is at ``path``, looking at it with ``lstat`` first: a folder (not a link to one)
    with its contents, anything else (a link, a file, a named pipe) by unlinking it. Errors are
    ignored, as ``shutil.rmtree(ignore_errors=True)`` ignores them. ``shutil.rmtree`` alone opens
    its argument for reading before it knows what it is, so a named pipe under a name a save
    removes (``iter_N``, ``iter_N.tmp``, ``iter_N.old``) waited for a writer forever, and a link
    to a folder outside was left behind."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def publish(save_dir, staging, final_dir, iteration, keep_last, protect=()) -> None:
    """Rename the staged folder into place, then replace the tracker atomically; remove the
    leftovers of killed saves and, with ``keep_last``, older checkpoints
    (:func:`checkpoints_to_remove`; ``protect`` is kept)."""
    old = final_dir + ".old"
    if os.path.lexists(final_dir):  # re-saving an iteration (after a restart), or a link there
        remove_path(old)
        os.rename(final_dir, old)
    os.rename(staging, final_dir)
    remove_path(old)
    tracker = get_checkpoint_tracker_filename(save_dir)
    tmp = tracker + ".tmp"
    # Non-blocking, not through a link: a named pipe put there since the start-up check
    # (save_folder.check_tracker_files) is an error (ENXIO), not a wait for a reader forever.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointSaveError(f"{tmp} is a {save_folder.file_kind(tmp)}, not the tracker's "
                                      "temporary file: remove it")
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker)
    fsync_dir(save_dir)  # make the renames themselves durable
    # Staging folders of saves killed earlier: nothing points at them, and no other live job
    # writes here (this one holds the folder's lock, checked at the start of the save).
    for stale in glob.glob(os.path.join(save_dir, "iter_*.tmp")) + glob.glob(
            os.path.join(save_dir, "iter_*.old")):
        remove_path(stale)
    for d in checkpoints_to_remove(save_dir, keep_last, final_dir, protect):
        remove_path(d)
