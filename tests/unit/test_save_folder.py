"""megatron.checkpointing.save_folder: an unusable --save is refused before training; one job per folder (the
lock file); megatron.checkpointing.checkpoint_folder.checkpoints_to_remove keeps the last good checkpoint."""

import json
import re
import os
import socket
import subprocess
import sys
from collections import namedtuple

import pytest

from megatron.checkpointing import save_folder as sf
from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
from megatron.checkpointing.checkpoint_folder import checkpoints_to_remove
from megatron.usage_error import UsageError


def test_a_file_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("")
    with pytest.raises(UsageError, match=rf"^--save \({path}\) is a file, not a folder"):
        sf.check_save_folder(str(path), 0)


def test_a_folder_that_cannot_be_created_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(UsageError, match=r"^--save \(.*/f/ckpt\) cannot be created \(Not a "
                                         r"directory\): give a folder this job can write"):
        sf.check_save_folder(str(tmp_path / "f" / "ckpt"), 0)


def test_a_symlink_to_nothing_is_refused_naming_its_target(tmp_path):
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "gone" / "ckpt")
    with pytest.raises(UsageError, match=rf"^--save \({link}\) is a symbolic link to "
                                         rf"{tmp_path}/gone/ckpt, which does not exist: create "
                                         r"that folder, or give --save a folder$"):
        sf.check_save_folder(str(link), 0)
    assert link.is_symlink() and not (tmp_path / "gone").exists()  # nothing created
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "ckpt").mkdir()
    assert sf.check_save_folder(str(link), 0) is False  # a link to a folder is that folder


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_an_unwritable_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    with pytest.raises(UsageError, match=r"is not writable by this job"):
        sf.check_save_folder(str(folder), 0)


def test_too_little_free_space_is_refused_and_the_new_folder_removed(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sf.shutil, "disk_usage", lambda p: usage(10 ** 10, 10 ** 10 - 5 * 10 ** 8,
                                                                 5 * 10 ** 8))
    folder = tmp_path / "new"
    with pytest.raises(UsageError, match=r"^--save \(.*new\) has 0\.5 GB free, less than one "
                                         r"checkpoint of this run \(about 2 GB\): free space"):
        sf.check_save_folder(str(folder), 2 * 10 ** 9)
    assert not folder.exists()
    assert sf.check_save_folder(str(folder), 10 ** 8) is True and folder.is_dir()
    assert sf.check_save_folder(str(folder), 10 ** 8) is False


def _write_lock(folder, **fields):
    holder = dict(host=socket.gethostname(), pid=os.getpid(), job="", started="then",
                  token="t0", process_start=None)
    holder.update(fields)
    (folder / sf.LOCK_FILENAME).write_text(json.dumps(holder))


def test_the_lock_is_taken_and_released(tmp_path):
    lock = sf.SaveFolderLock(str(tmp_path))
    assert lock.acquire() == []
    held = json.loads((tmp_path / sf.LOCK_FILENAME).read_text())
    assert held["host"] == socket.gethostname() and held["pid"] == os.getpid()
    assert set(held) == {"host", "pid", "job", "started", "token", "process_start"}
    sf.check_not_held_by_another_job(str(tmp_path))  # its own: no error
    lock.release()
    assert os.listdir(tmp_path) == []


def test_a_live_job_on_this_host_is_respected(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, pid=other.pid, job="slurm:42",
                    process_start=sf._process_start(other.pid))
        with pytest.raises(UsageError, match=rf"^--save \({tmp_path}\) is in use by another job "
                                             rf"\(host {socket.gethostname()}, pid {other.pid}, "
                                             r"job slurm:42, started then; lock file .*"
                                             r"megatron_save\.lock\).*wait for it to end or give "
                                             r"this run another --save folder$"):
            sf.SaveFolderLock(str(tmp_path)).acquire()
        with pytest.raises(CheckpointError, match=r"is now held by another job .* it saves "
                                                  r"nothing there and deletes nothing"):
            sf.check_not_held_by_another_job(str(tmp_path))
    finally:
        other.kill()
        other.wait()


def test_a_dead_process_s_lock_is_taken_over_saying_so(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(tmp_path, pid=gone.pid)
    lock = sf.SaveFolderLock(str(tmp_path))
    notes = lock.acquire()
    assert notes == [f"--save {tmp_path}: took over the lock of host {socket.gethostname()}, "
                     f"pid {gone.pid}, started then: process {gone.pid} on this host has ended"]
    assert json.loads((tmp_path / sf.LOCK_FILENAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_reused_pid_is_not_taken_for_the_holder(tmp_path):
    _write_lock(tmp_path, pid=os.getppid(), process_start="1")  # alive, but started at tick 1
    assert "has ended" in sf.SaveFolderLock(str(tmp_path)).acquire()[0]


def test_another_host_s_lock_is_respected_and_the_message_says_how_to_remove_it(tmp_path):
    _write_lock(tmp_path, host="node-b", pid=1, job="slurm:7")
    with pytest.raises(UsageError, match=r"in use by another job \(host node-b, pid 1, job "
                                         r"slurm:7.*runs on another host, which cannot be checked "
                                         rf"from here: if it is no longer running, delete "
                                         rf"{tmp_path}/megatron_save\.lock and start again$"):
        sf.SaveFolderLock(str(tmp_path)).acquire()


def test_an_earlier_attempt_of_the_same_job_on_another_host_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    _write_lock(tmp_path, host="node-b", pid=1, job="slurm:7")
    notes = sf.SaveFolderLock(str(tmp_path)).acquire()
    assert notes[0].endswith("it is an earlier attempt of this job (slurm:7) on host node-b")


def test_torchrun_s_default_run_id_names_no_job(tmp_path, monkeypatch):
    # torchrun without --rdzv-id (nor --standalone) sets TORCHELASTIC_RUN_ID to "none" in every
    # job: two such jobs on two hosts are not attempts of one job.
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert sf.job_id() == ""
    _write_lock(tmp_path, host="node-b", pid=1, job="torchrun:none")
    with pytest.raises(UsageError, match=r"in use by another job \(host node-b, pid 1, job "
                                         r"torchrun:none"):
        sf.SaveFolderLock(str(tmp_path)).acquire()


@pytest.mark.parametrize("pid", ["123", 2 ** 70, None, 1.5, True])
def test_a_lock_file_with_a_pid_that_is_no_process_id_is_named(tmp_path, pid):
    _write_lock(tmp_path, pid=pid)
    with pytest.raises(UsageError, match=r"the lock file .* names no job .*delete .* and start"):
        sf.SaveFolderLock(str(tmp_path)).acquire()


def test_a_garbage_lock_file_is_named(tmp_path):
    (tmp_path / sf.LOCK_FILENAME).write_text("not json")
    with pytest.raises(UsageError, match=r"the lock file .* names no job .*delete .* and start"):
        sf.SaveFolderLock(str(tmp_path)).acquire()


def test_release_leaves_a_lock_another_job_took_over(tmp_path):
    lock = sf.SaveFolderLock(str(tmp_path))
    lock.acquire()
    _write_lock(tmp_path, host="node-b", token="theirs")
    lock.release()
    assert json.loads((tmp_path / sf.LOCK_FILENAME).read_text())["token"] == "theirs"


def _checkpoints(folder, *iterations):
    for it in iterations:
        (folder / f"iter_{it:07d}").mkdir()
    return str(folder / f"iter_{iterations[-1]:07d}")


def test_keep_last_never_deletes_the_protected_or_later_checkpoints(tmp_path):
    final = _checkpoints(tmp_path, 1, 2, 3, 4, 5)
    (tmp_path / "iter_0000009").mkdir()  # of a later iteration (a resume from 5 left it)
    names = lambda ds: [os.path.basename(d) for d in ds]  # noqa: E731
    assert names(checkpoints_to_remove(str(tmp_path), 1, final)) == [
        "iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004"]
    assert names(checkpoints_to_remove(str(tmp_path), 2, final,
                                       protect=(str(tmp_path / "iter_0000002"),))) == [
        "iter_0000001", "iter_0000003"]
    assert checkpoints_to_remove(str(tmp_path), None, final) == []


def test_a_conversion_holds_its_target_folder_not_save():
    from types import SimpleNamespace

    plain = SimpleNamespace(save="ckpt", ckpt_convert_format=None, ckpt_convert_save=None)
    convert = SimpleNamespace(save=None, ckpt_convert_format="torch_dist", ckpt_convert_save="out")
    assert sf.save_target(plain) == "ckpt"
    assert sf.save_target(convert) == os.path.join("out", "torch_dist")


def _rank0_disk_fails(folder):
    import errno

    import torch
    import torch.distributed as dist

    sf.save_target = lambda checkpoint: folder
    sf.checkpoint_bytes = lambda config: 0
    disk_usage = sf.shutil.disk_usage
    if dist.get_rank() == 0:
        def broken(path):
            raise OSError(errno.EIO, "Input/output error", path)
        sf.shutil.disk_usage = broken
    try:
        sf.hold_save_folder(namedtuple("config", "checkpoint")(None), torch.device("cpu"))
    except UsageError as exc:
        return str(exc)
    finally:
        sf.shutil.disk_usage = disk_usage  # the shutil module is shared by the whole process
    return None


def test_an_os_error_on_rank_0_is_one_usage_error_on_every_rank(tmp_path):
    """An OSError of rank 0's checks (here disk_usage) reaches every rank as a usage error; no
    rank waits in a collective for rank 0 (the world would time out)."""
    from tests.helpers.dist import run_distributed

    folder = str(tmp_path / "ckpt")
    said = run_distributed(2, _rank0_disk_fails, folder, timeout=60)
    assert said[0] == (f"--save ({folder}): Input/output error ({folder}): give a folder this "
                       "job can read and write")
    assert said[1] == "rank 0 found a usage error (see its line)"


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink"])
def test_a_lock_that_is_no_regular_file_is_refused_without_opening_it(tmp_path, kind):
    """Issue 31: a named pipe as the lock file hung start-up (open() for reading waits for a
    writer). Every non-regular file is refused in one line naming it."""
    import threading

    lock = tmp_path / sf.LOCK_FILENAME
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "folder":
        lock.mkdir()
    else:
        (tmp_path / "elsewhere").write_text(json.dumps({"host": "h", "pid": 1}))
        lock.symlink_to(tmp_path / "elsewhere")
    outcome = []

    def take():
        try:
            sf.SaveFolderLock(str(tmp_path)).acquire()
        except UsageError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(timeout=20)
    if thread.is_alive() and kind == "fifo":  # unblock the hung reader before failing
        os.close(os.open(lock, os.O_WRONLY | os.O_NONBLOCK))
    assert not thread.is_alive(), "start-up hung on the lock file"
    assert len(outcome) == 1 and "\n" not in outcome[0], outcome
    assert re.search(rf"the lock file {re.escape(str(lock))} is a "
                     r"(named pipe|folder|symbolic link), not a lock file this program wrote; "
                     rf"if no job uses .*, remove {re.escape(str(lock))}", outcome[0]), outcome
    assert os.path.lexists(lock)  # left as found


def test_a_huge_lock_file_is_refused_without_being_read_whole(tmp_path):
    """A lock this program writes is ~200 bytes of JSON; a multi-gigabyte file in its place (a
    sparse file, a log written there by mistake) must not be read into memory to find that out."""
    import tracemalloc

    size = 64 * 2 ** 20
    with open(tmp_path / sf.LOCK_FILENAME, "wb") as f:
        f.truncate(size)  # sparse: no disk used
    tracemalloc.start()
    try:
        with pytest.raises(UsageError, match=rf"the lock file .* names no job \(it holds {size:,} "
                                             r"bytes.*\).*delete .* and start"):
            sf.SaveFolderLock(str(tmp_path)).acquire()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < sf.LOCK_MAX_BYTES * 8  # before: the whole file, twice (bytes, then text)


# --- a --load folder without the tracker (the fourth hostile pass) ------------------------------

def _refusal(load, save):
    from megatron.checkpointing.save_folder import check_load_folder

    try:
        check_load_folder(str(load), str(save) if save is not None else None)
    except UsageError as exc:
        return str(exc)
    return None


def test_a_load_folder_with_checkpoints_but_no_tracker_is_refused_even_as_the_save_folder(tmp_path):
    """Before: "starting from scratch", and the fresh run's save replaced iter_0000002."""
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000002").mkdir()
    for save in (tmp_path, tmp_path / "elsewhere"):
        message = _refusal(tmp_path, save)
        assert message is not None and "holds iter_0000001, iter_0000002 but no " \
            "latest_checkpointed_iteration.txt" in message and f"echo 2 > {tmp_path}" in message


@pytest.mark.parametrize("mark", ["mp_rank_00", "mp_rank_01_001", "common.pt", ".metadata",
                                  "__0_0.distcp"])
def test_one_checkpoints_own_folder_given_as_load_is_refused_naming_its_parent(tmp_path, mark):
    """``--load ck/iter_0000002 --save ck``: before, a fresh run whose save replaced it."""
    iteration = tmp_path / "ck" / "iter_0000002"
    iteration.mkdir(parents=True)
    (iteration / mark).mkdir() if mark.startswith("mp_rank") else (iteration / mark).write_bytes(b"")
    message = _refusal(iteration, tmp_path / "ck")
    assert message is not None and "one checkpoint's own folder" in message
    assert f"the folder above it, {tmp_path / 'ck'}" in message
    other = tmp_path / "renamed"  # the folder's name alone does not decide it
    iteration.rename(other)
    assert "one checkpoint's own folder" in _refusal(other, tmp_path / "ck")


def test_a_load_folder_that_is_not_the_save_folder_and_holds_no_checkpoint_is_refused(tmp_path):
    empty, hf, save = tmp_path / "empty", tmp_path / "hf", tmp_path / "save"
    empty.mkdir()
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert "is empty: it has no latest_checkpointed_iteration.txt and is not the --save" in \
        _refusal(empty, save)
    message = _refusal(hf, save)
    assert "holds no checkpoint (config.json, model.safetensors)" in message
    assert "tools/checkpoint/convert.py --loader hf" in message
    assert "is empty" in _refusal(empty, None)


def test_the_save_folder_without_a_checkpoint_starts_from_scratch(tmp_path):
    """"Resume if there is something": --load = --save, empty or holding only logs or a lock."""
    assert _refusal(tmp_path, tmp_path) is None
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "megatron_save.lock").write_text("{}")
    assert _refusal(tmp_path, str(tmp_path) + "/") is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    assert _refusal(tmp_path, tmp_path / "other") is None  # the tracker's content: checked later


@pytest.mark.parametrize("planted", ["named pipe", "link to an outside file"])
def test_a_planted_lock_temporary_is_neither_opened_nor_written_through(tmp_path, planted):
    """The lock's creation temporary had a predictable name (host and pid, which repeat across
    containers): a pipe there hung start-up, a link there had an outside file overwritten."""
    save = tmp_path / "save"
    save.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    name = save / f"{sf.LOCK_FILENAME}.new.{socket.gethostname()}.{os.getpid()}"
    os.mkfifo(name) if planted == "named pipe" else os.symlink(outside, name)
    lock = sf.SaveFolderLock(str(save))
    lock.acquire()  # a hang here is the failure (pytest's timeout ends it)
    try:
        assert json.loads((save / sf.LOCK_FILENAME).read_text())["pid"] == os.getpid()
        assert outside.read_text() == "keep me" and os.path.lexists(name)
    finally:
        lock.release()
