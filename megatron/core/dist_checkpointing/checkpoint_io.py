"""Reading ``torch.save`` files without running code from them, and refusing damaged ones.

Every file written by ``torch.save`` that this project reads goes through :func:`load_torch_file`:
our checkpoints (``model_optim_rng.pt``), the distributed optimizer's ``distrib_optim_dp_DDD.pt``
shards, HuggingFace ``pytorch_model*.bin`` weights and other systems' Megatron checkpoints in the
converters. It

1. checks every record of the zip archive against the CRC-32 stored beside it
   (:func:`verify_checksums`). ``torch.load`` does not: a flipped byte inside a tensor's storage
   loads silently, with or without ``mmap``. ``torch.save`` writes the CRCs (unless
   ``torch.serialization.set_crc32_options(False)`` turned them off; records without one, CRC 0,
   are skipped), so files written by any system's ``torch.save`` are covered without a sidecar.
   Cost: one pass of ``zlib.crc32`` over the file: 48-99 ms per 100 MB on a shared 2-core
   machine, beside 84-236 ms for the load itself, page cache warm (``benchmarks/checkpoint_io.py``);
2. reads it with ``torch.load(weights_only=True)``: torch's restricted unpickler builds tensors,
   containers and plain values only, plus the classes a caller lists in ``extra_globals`` (each a
   class that runs no code when built: ``argparse.Namespace`` for Megatron-LM's ``args``);
3. turns torch's errors into one sentence naming the file, what is wrong and what to do. A refused
   pickle names the globals the file asks for (``posix.system``) and never suggests
   ``weights_only=False``, which would run them.
"""

from __future__ import annotations

import mmap as _mmap
import os
import pickle
import re
import struct
import warnings
import zipfile
import zlib

import torch

from megatron.usage_error import UsageError


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupt or does not fit the model."""


class CheckpointSaveError(CheckpointError):
    """A save that failed on some rank (a full disk, a file-size limit, a lost ``--save`` folder),
    agreed by every rank (:func:`megatron.checkpointing.checkpoint_folder.agree_on_save_error`); the previous
    checkpoint and the tracker are untouched. Not the user's mistake, so not a usage error: the
    command prints the one line on rank ``reporter`` alone, without a traceback, and exits 1.

    Args:
        message: the reporter's own reason (which file, the OS's words); another rank's names
            the reporter.
        reporter: the global rank that prints the line (the lowest that failed).
    """

    def __init__(self, message: str, *, reporter: int = 0):
        super().__init__(message)
        self.reporter = reporter


class CheckpointUsageError(UsageError, CheckpointError):
    """A :class:`CheckpointError` met while loading, as the user gets it: a usage error (one line,
    printed once for the job, status 2; :mod:`megatron.usage_error`) that callers catching
    ``CheckpointError`` still catch."""


class UnreadableFileError(CheckpointError):
    """A file cannot be used as saved: missing, truncated, damaged (CRC mismatch) or refused
    (it pickles objects other than tensors and plain data). The caller may name an older,
    complete checkpoint to fall back on."""


class _WriteErrorRecorder:
    """A file object's proxy keeping the ``OSError`` of a failed write (everything else passes
    through)."""

    def __init__(self, file):
        self._file, self.error = file, None

    def write(self, data):
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name):
        return getattr(self._file, name)


def save_to_file(obj, file, path: str, save=None) -> None:
    """``torch.save(obj, file)`` (or ``save(obj, proxy)``) into the open binary ``file`` of
    ``path``, a failed write raised as the ``OSError`` it was.

    ``torch.save`` reports a Python file object's failed write (a full disk, a file-size limit)
    as ``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos ...``, which
    names neither the file nor the cause.

    Raises:
        OSError: the write's errno and reason, with ``path`` as the filename.
    """
    recorder = _WriteErrorRecorder(file)
    try:
        (save or torch.save)(obj, recorder)
    except RuntimeError:
        if recorder.error is None:
            raise
        raise OSError(recorder.error.errno, recorder.error.strerror, path) from None


_LOCAL_HEADER = b"PK\x03\x04"
_CHUNK = 64 << 20  # crc32 runs over slices of this size (bounded work per call)


def verify_checksums(path: str, what: str = "file") -> None:
    """Compare every record of the zip archive ``path`` with its stored CRC-32 (records in
    parallel threads: ``zlib.crc32`` releases the GIL).

    Args:
        path: a ``torch.save`` file in the zip format.
        what: how the file is called in messages ("checkpoint shard").

    Raises:
        UnreadableFileError: the archive's structure is broken, or a record's bytes differ from
            its CRC (names the file and the record).
    """
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as archive, \
                _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ) as data:
            _verify_archive(archive, data, path, what)
    except (zipfile.BadZipFile, struct.error, ValueError, OSError) as exc:
        raise UnreadableFileError(f"cannot read {what} {path}: damaged zip archive ({exc}); "
                                  "it was not loaded") from None


def verify_bytes_checksums(data: bytes, name: str, what: str = "record") -> None:
    """:func:`verify_checksums` for a ``torch.save`` archive held in memory (one record of a
    distributed checkpoint's ``__R_K.distcp`` file); ``name`` says where it came from."""
    import io

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            _verify_archive(archive, data, name, what)
    except (zipfile.BadZipFile, struct.error, ValueError) as exc:
        raise UnreadableFileError(f"cannot read {what} {name}: damaged zip archive ({exc}); "
                                  "it was not loaded") from None


def _verify_archive(archive: zipfile.ZipFile, data, name: str, what: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    records = [i for i in archive.infolist() if i.CRC != 0]  # 0: written without a CRC
    for info in records:
        if info.compress_type != zipfile.ZIP_STORED:  # not torch's; zipfile checks it
            with archive.open(info) as record:
                while record.read(_CHUNK):
                    pass
    stored = [i for i in records if i.compress_type == zipfile.ZIP_STORED]
    big = [i for i in stored if i.compress_size >= _CHUNK]
    for info in stored:  # small records (pickles, a box of a distributed checkpoint) inline
        if info not in big:
            _check_stored_record(data, info, name, what)
    if big:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(big))) as pool:
            for _ in pool.map(lambda info: _check_stored_record(data, info, name, what), big):
                pass


def _check_stored_record(data, info: zipfile.ZipInfo, path: str, what: str) -> None:
    offset = info.header_offset
    if data[offset:offset + 4] != _LOCAL_HEADER:
        raise zipfile.BadZipFile(f"record {info.filename} has no local header at byte {offset}")
    name_len, extra_len = struct.unpack("<HH", data[offset + 26:offset + 30])
    start = offset + 30 + name_len + extra_len
    end = start + info.compress_size
    if end > len(data):
        raise zipfile.BadZipFile(f"record {info.filename} ends past the end of the file")
    crc = 0
    view = memoryview(data)
    try:
        for chunk_start in range(start, end, _CHUNK):
            crc = zlib.crc32(view[chunk_start:min(end, chunk_start + _CHUNK)], crc)
    finally:
        view.release()
    if crc != info.CRC:
        raise UnreadableFileError(
            f"cannot read {what} {path}: record {info.filename} fails its CRC-32 check (stored "
            f"{info.CRC:08x}, computed {crc:08x}): the file changed after it was written (a "
            "flipped bit, a bad disk or an interrupted copy); it was not loaded")


_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation")
# torch's names for what its restricted unpickler refused
_REFUSED = (re.compile(r"GLOBAL ([\w.]+)"), re.compile(r"but got <class '([\w.]+)'>"))


def _detail(exc: BaseException) -> str:
    """The informative line of a torch error, without torch's advice to disable the restricted
    unpickler (our messages never suggest ``weights_only=False``)."""
    lines = [line.strip() for line in str(exc).splitlines()]
    useful = [line for line in lines
              if line and not line.startswith(_ADVICE) and "weights_only" not in line]
    return useful[0] if useful else type(exc).__name__


def _named_in_error(exc: BaseException) -> set:
    return {m.group(1) for pattern in _REFUSED for m in pattern.finditer(str(exc))}


def _pickle_globals(f) -> set:
    """``module.name`` of every global one pickle in ``f`` names (``GLOBAL``, and
    ``STACK_GLOBAL`` after its two strings), read by :func:`pickletools.genops`: nothing is
    built."""
    import pickletools

    names, strings = set(), []
    for op, arg, _ in pickletools.genops(f):
        if op.name == "GLOBAL":
            names.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.add(f"{strings[-2]}.{strings[-1]}")
        elif isinstance(arg, str):
            strings.append(arg)
    return names


def _refused_globals(path: str, allowed: set, is_zip: bool):
    """``(names, parsed)``: the globals the file's pickle names that the restricted unpickler
    refuses, read statically, and whether the pickle parsed at all (a damaged one does not). A
    legacy-format file (or a bare pickle) is a sequence of pickles: the first four are read."""
    found, parsed = set(), True
    if is_zip:
        try:
            found = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception:  # noqa: BLE001 - an unparsable pickle
            parsed = False
    else:
        with open(path, "rb") as f:
            for i in range(4):  # magic number, protocol, sys info, the object
                try:
                    found |= _pickle_globals(f)
                except Exception:  # noqa: BLE001 - the end, raw storage bytes, or damage
                    parsed = i > 0
                    break
        try:
            from torch._weights_only_unpickler import _get_allowed_globals
            found -= set(_get_allowed_globals())
        except ImportError:
            pass
    return sorted(g for g in found if g not in allowed), parsed


def _global_name(entry) -> str:
    if isinstance(entry, tuple):
        return entry[1]
    return f"{entry.__module__}.{entry.__qualname__}"


def load_torch_file(path: str, *, what: str = "file", mmap: bool = False, extra_globals=(),
                    verify: bool = True):
    """``torch.load(path, map_location="cpu", weights_only=True)``, checked and explained.

    Args:
        path: a file written by ``torch.save`` (zip format; the legacy format loads too, without
            a CRC check, as it has none).
        what: how the file is called in messages ("checkpoint shard", "weights file").
        mmap: memory-map the tensors (zip format only; the legacy format is read whole).
        extra_globals: classes, or ``(object, "module.Name")`` pairs, the restricted unpickler
            may build besides tensors and plain data (``torch.serialization.safe_globals``).
        verify: check the CRC-32 of every record first (:func:`verify_checksums`); False only for
            a file this process has just written itself.

    Returns:
        the unpickled object (tensors on the CPU).

    Raises:
        UnreadableFileError: missing, truncated or damaged (names the record failing its CRC),
            or refused because its pickle asks for other objects (names them; nothing from the
            file was run).
    """
    if not os.path.isfile(path):
        raise UnreadableFileError(f"cannot read {what} {path}: " + (
            "it is no regular file (a named pipe, a folder, a device or a broken link; it was "
            "not opened)" if os.path.lexists(path) else "it does not exist"))
    is_zip = zipfile.is_zipfile(path)
    if verify and is_zip:
        verify_checksums(path, what)
    try:
        with torch.serialization.safe_globals(list(extra_globals)), warnings.catch_warnings():
            # A bare pickle (not torch.save's) makes torch warn about its protocol before the
            # refusal below says what the file is: one line for the user, not two.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and is_zip)
    except pickle.UnpicklingError as exc:
        allowed = {_global_name(g) for g in extra_globals}
        names, parsed = _refused_globals(path, allowed, is_zip)
        names = sorted(set(names) | (_named_in_error(exc) - allowed))
        if not names and not parsed:  # not a refusal: a damaged pickle
            raise _unreadable(path, what, exc) from None
        asked = (f"its pickle asks for {', '.join(names)}" if names else
                 f"its pickle holds what the restricted unpickler refuses ({_detail(exc)})")
        raise UnreadableFileError(
            f"refused to load {what} {path}: {asked}, not only tensors and plain data; building "
            "it could run code from the file, so it was not loaded and nothing in it ran. Use a "
            "file saved from tensors and plain values (a state_dict), or convert another "
            "system's checkpoint with tools/checkpoint/convert.py") from None
    except Exception as exc:  # noqa: BLE001 - torch reports damage as RuntimeError, EOFError, ...
        raise _unreadable(path, what, exc) from None


def _unreadable(path: str, what: str, exc: BaseException) -> UnreadableFileError:
    return UnreadableFileError(
        f"cannot read {what} {path}: {type(exc).__name__}: {_detail(exc)}; the file is truncated "
        "or corrupt (or not a torch.save file) and was not loaded")
