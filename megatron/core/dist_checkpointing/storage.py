"""Writing and reading :class:`~megatron.core.dist_checkpointing.mapping.ShardedTensor` boxes with
``torch.distributed.checkpoint`` (DCP), resharding on load.

Files (DCP's ``FileSystemWriter``): ``__R_0.distcp`` per writing rank R (each box one
``torch.save`` record, concatenated) and ``.metadata``, written last by rank 0 of the group once
every rank has written: the global shape, dtype and boxes of every key, and where each box lies.

On load every rank names the boxes it wants, in any layout; DCP intersects them with the saved
boxes and reads the overlaps into the wanted tensors in place. Our planners replace DCP's default
ones so a rank can hold several boxes of one key (flat ranges of the distributed optimizer) and
no state-dict flattening or pickled Python objects are involved.

Nothing in the files is executed: ``.metadata`` is a pickle, read here by an unpickler that builds
only DCP's metadata classes, torch sizes and dtypes, and refuses anything else naming the file and
the global; each box is a ``torch.save`` archive whose CRC-32s are checked before
``torch.load(weights_only=True)`` (:mod:`megatron.core.dist_checkpointing.checkpoint_io`: a flipped bit is refused, not
loaded); file names in the metadata must be plain ``__R_K.distcp`` names inside the checkpoint
folder. Each stored record is read once however many wanted boxes overlap it.

Save ids (issue 31): every writing rank puts a record of its own random id first in its data file,
under the key ``__save_id__/RANK/ID`` (so ``.metadata`` names it), and the caller stores rank 0's
id beside the checkpoint (``common.pt``). Reading a data file starts with that record: a file
copied in from another save (same layout, same offsets, valid CRCs) is refused naming the file,
and :func:`check_save_id` ties ``.metadata`` to ``common.pt``. A checkpoint written before the ids
has none and loads as before (:func:`check_save_id` says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import pickle
import re
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron.core.dist_checkpointing.checkpoint_io import save_to_file
from megatron.core.dist_checkpointing.errors import (METADATA_FILE, CheckpointFormatError,
                                                     CheckpointWriteError)
from megatron.core.dist_checkpointing.mapping import ShardedTensor

__all__ = ["METADATA_FILE", "CheckpointFormatError", "CheckpointWriteError", "check_fits", "check_save_id", "load",
           "read_metadata", "save", "save_ids", "tensor_shapes", "SAVE_ID_PREFIX"]

_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")
SAVE_ID_PREFIX = "__save_id__/"
_SAVE_ID_KEY = re.compile(r"__save_id__/(\d+)/([0-9a-f]{32})")


def _first_failure(exc: CheckpointException) -> Tuple[int, BaseException]:
    """The lowest failing rank of DCP's exception and its own exception."""
    rank = min(exc.failures)
    failure = exc.failures[rank]
    return rank, failure[0] if isinstance(failure, tuple) else failure


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when torch.distributed is not initialized: that is
    what we mean then."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# Saving ------------------------------------------------------------------------------------------

def _index(t: ShardedTensor) -> MetadataIndex:
    return MetadataIndex(t.key, torch.Size(t.global_offset))


class _SavePlanner(DefaultSavePlanner):
    """Writes the boxes with ``replica_id == 0`` given at construction (the state dict DCP passes
    is empty); DCP's global step then checks that the boxes of every key cover it without
    overlap, and we refuse a box that two ranks both claim (a bug in choosing writers)."""

    def __init__(self, tensors: Sequence[ShardedTensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._boxes: Dict[MetadataIndex, torch.Tensor] = {}
        self._items: List[WriteItem] = []
        for t in tensors:
            if t.replica_id:
                continue
            index = _index(t)
            if index in self._boxes:
                raise ValueError(f"{t.key}: two boxes at offset {t.global_offset} on one rank")
            self._boxes[index] = t.data
            self._items.append(WriteItem(
                index=index, type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(t.global_offset),
                                               sizes=torch.Size(t.data.shape)),
                    properties=TensorProperties.create_from_tensor(t.data),
                    size=torch.Size(t.global_shape))))

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(list(self._items))
        return self.plan

    def _dedup_save_plans(self, all_plans: List[SavePlan]) -> List[SavePlan]:
        seen = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                if item.index in seen:
                    raise ValueError(f"{item.index.fqn}: the box at offset {list(item.index.offset)} "
                                     f"is written by ranks {seen[item.index]} and {rank}")
                seen[item.index] = rank
        return all_plans

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        for key, md in metadata.state_dict_metadata.items():  # DCP checks this only for >1 rank
            covered = sum(math.prod(c.sizes) for c in md.chunks)
            if covered != math.prod(md.size):
                raise ValueError(f"{key}: the boxes written cover {covered} of the "
                                 f"{math.prod(md.size)} elements of shape {list(md.size)}")
        return plans, metadata

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._boxes[write_item.index]


class _Writer(FileSystemWriter):
    """``FileSystemWriter`` writing this rank's boxes one after the other into one file, each
    copied out of a larger storage just before it is written and dropped after: peak extra
    memory one box (DCP's own loop keeps every such copy until the file is done: 2.35 GiB for a
    1.1 B-parameter model's weights, whose q/k/v and gate/up boxes are views)."""

    def write_data(self, plan: SavePlan, planner) -> "torch.futures.Future":
        from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        path = self.fs.concat_path(self.path, name)
        try:
            return self._write_file(plan, planner, name, path)
        except OSError as exc:  # a flush or fsync names no file: name it
            if exc.filename is not None or exc.errno is None:
                raise
            raise OSError(exc.errno, exc.strerror, str(path)) from None

    def _write_file(self, plan, planner, name, path) -> "torch.futures.Future":
        from torch.distributed.checkpoint.filesystem import _write_item

        results = []
        with self.fs.create_stream(path, "wb") as stream:
            for item in plan.items:
                data = planner.resolve_data(item).detach().cpu()
                if data.untyped_storage().nbytes() != data.nbytes:
                    data = data.clone()  # torch.save writes a view's whole storage
                # a failed write (full disk, file-size limit) as the OSError naming the file
                save_to_file(data, stream, str(path),
                             save=lambda d, f: results.append(_write_item(
                                 self.transforms, f, d, item, name, self.serialization_format)))
                del data
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        fut = torch.futures.Future()
        fut.set_result(results)
        return fut


def _new_save_id() -> Optional[str]:
    """A fresh id of 32 hex digits (``uuid4``) for this rank's part of a save."""
    import uuid

    return uuid.uuid4().hex


def _save_id_box(rank: int, save_id: str) -> ShardedTensor:
    data = torch.frombuffer(bytearray(save_id.encode("ascii")), dtype=torch.uint8)
    return ShardedTensor(f"{SAVE_ID_PREFIX}{rank}/{save_id}", data, (len(save_id),), (0,))


def save(tensors: Sequence[ShardedTensor], directory: str, *, process_group=None) -> Optional[str]:
    """Write this rank's boxes into ``directory``, its save id first (module docstring).
    Collective over ``process_group`` (every rank of it calls this with its own boxes; None: the
    default group, or one process without ``torch.distributed``).

    Args:
        tensors: the boxes this rank holds; those with ``replica_id > 0`` are not written here.
        directory: the checkpoint folder (created if missing).

    Returns:
        this rank's save id (rank 0's is to be stored beside the checkpoint: ``check_save_id``).

    Raises:
        CheckpointWriteError: on every rank when a write failed on any (e.g. a full disk), naming
            the lowest failing rank and its error.
    """
    writer = _Writer(directory, single_file_per_rank=True, sync_files=True)
    save_id = _new_save_id()
    if save_id is not None:
        rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        tensors = [_save_id_box(rank, save_id), *tensors]  # first: at byte 0 of the file
    try:
        with _single_process_quiet():
            dcp.save({}, storage_writer=writer, planner=_SavePlanner(tensors),
                     process_group=process_group, no_dist=not dist.is_initialized())
    except CheckpointException as exc:
        rank, cause = _first_failure(exc)
        if isinstance(cause, ValueError):  # the boxes given do not make a checkpoint (a bug)
            raise ValueError(f"{directory}: {cause}") from None
        raise CheckpointWriteError(f"rank {rank} could not write its part of {directory}: "
                                   f"{type(cause).__name__}: {cause}") from None
    return save_id


# Reading the metadata ---------------------------------------------------------------------------

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron-Core caches its global save plan in the metadata (inert dataclasses and an enum)
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "TensorWriteData",
                                             "WriteItemType"},
    "torch.serialization": {"_get_layout"},  # builds torch.strided from its name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else (see the module docstring)."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointFormatError(
            f"{self.path} asks to build {module}.{name}, which is not part of a distributed "
            "checkpoint's metadata: refused (nothing from a checkpoint is executed)")


def read_metadata(directory: str) -> Metadata:
    """DCP's metadata of the checkpoint in ``directory`` (see the module docstring).

    Raises:
        CheckpointFormatError: missing, truncated or refused (names the file and the reason).
    """
    path = os.path.join(directory, METADATA_FILE)
    _refuse_special(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointFormatError:
        raise
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path} does not exist: {directory} is not a complete "
                                    "distributed checkpoint") from None
    except Exception as exc:  # noqa: BLE001 - pickle raises many types for damaged files
        raise CheckpointFormatError(f"cannot read {path}: {type(exc).__name__}: {exc} (a "
                                    "truncated or damaged file)") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointFormatError(f"{path} does not hold distributed-checkpoint metadata")
    for info in metadata.storage_data.values():
        if not _DATA_FILE.fullmatch(str(info.relative_path)):
            raise CheckpointFormatError(f"{path} names the data file {info.relative_path!r}; "
                                        "only __R_K.distcp files in the folder are read")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointFormatError(f"{path}: records written with stream transforms "
                                        f"{info.transform_descriptors} are not read")
    _check_shapes(metadata, directory, path)
    return metadata


def _refuse_special(path: str) -> None:
    """Refuse a checkpoint file that exists but is no regular file (a named pipe would block
    ``open`` forever), without opening it."""
    if os.path.lexists(path) and not os.path.isfile(path):
        from megatron.file_kinds import file_kind

        raise CheckpointFormatError(f"{path} is a {file_kind(path)}, not a checkpoint file: it "
                                    "was not opened; restore the file, or load the last complete "
                                    "checkpoint")


def _nonnegative_ints(values) -> bool:
    return all(type(v) is int and v >= 0 for v in values)


def _check_shapes(metadata: Metadata, directory: str, path: str) -> None:
    """Refuse metadata whose shapes, boxes or record places cannot describe the files: a global
    shape of negative or non-integer sizes, a box outside it or of another rank, boxes that do
    not cover it once, a box with no record, or a record larger than its data would be or lying
    beyond the end of its file (so nothing is allocated from a crafted shape).

    Raises:
        CheckpointFormatError: naming ``path`` and the key.
    """
    sizes = {}
    for index, info in metadata.storage_data.items():
        file = os.path.join(directory, str(info.relative_path))
        if file not in sizes:
            _refuse_special(file)
            sizes[file] = os.path.getsize(file) if os.path.isfile(file) else None
        if not _nonnegative_ints((info.offset, info.length)) or (
                sizes[file] is not None and info.offset + info.length > sizes[file]):
            if _nonnegative_ints((info.offset, info.length)) and info.offset <= sizes[file]:
                # The record starts inside the file: the file was cut short (a crash while
                # copying, a full disk), the usual case, said as such.
                raise CheckpointFormatError(
                    f"{file} ends before the record of {index.fqn} (byte "
                    f"{info.offset + info.length}): truncated. It has {sizes[file]} bytes; "
                    f"{path} places the record at bytes {info.offset} + {info.length} (or the "
                    "metadata belongs to other files)")
            raise CheckpointFormatError(
                f"{path}: the record of {index.fqn} (bytes {info.offset!r} + {info.length!r}) "
                f"does not lie inside {file} ({sizes[file]} bytes): the metadata is damaged or "
                "belongs to other files")
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue

        def bad(why):
            return CheckpointFormatError(f"{path}: tensor {key} {why}; the metadata is damaged "
                                         "or was crafted (refused before anything is allocated)")

        shape = tuple(md.size)
        if not _nonnegative_ints(shape) or not isinstance(md.properties.dtype, torch.dtype):
            raise bad(f"has global shape {list(shape)} of dtype {md.properties.dtype!r}")
        itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
        covered = 0
        for chunk in md.chunks:
            offsets, lengths = tuple(chunk.offsets), tuple(chunk.sizes)
            if (len(offsets) != len(shape) or len(lengths) != len(shape)
                    or not _nonnegative_ints(offsets + lengths)
                    or any(o + n > s for o, n, s in zip(offsets, lengths, shape))):
                raise bad(f"has a box at {list(offsets)} of shape {list(lengths)} outside its "
                          f"global shape {list(shape)}")
            info = metadata.storage_data.get(MetadataIndex(key, torch.Size(offsets)))
            if info is None:
                raise bad(f"has a box at {list(offsets)} that no data file holds")
            if math.prod(lengths) * itemsize > info.length:
                raise bad(f"has a box at {list(offsets)} of shape {list(lengths)} "
                          f"({math.prod(lengths) * itemsize} bytes) in a record of "
                          f"{info.length} bytes")
            covered += math.prod(lengths)
        if covered != math.prod(shape):
            raise bad(f"has boxes covering {covered} of the {math.prod(shape)} elements of its "
                      f"global shape {list(shape)}")


def tensor_shapes(metadata: Metadata) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of every tensor in the checkpoint (save ids aside)."""
    return {k: (tuple(md.size), md.properties.dtype)
            for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) and not k.startswith(SAVE_ID_PREFIX)}


def save_ids(metadata: Metadata) -> Dict[str, Tuple[MetadataIndex, str, int]]:
    """``{data file name: (index of its id record, id, writing rank)}``; empty for a checkpoint
    written before save ids."""
    out = {}
    for index, info in metadata.storage_data.items():
        match = _SAVE_ID_KEY.fullmatch(index.fqn)
        if match:
            out[str(info.relative_path)] = (index, match.group(2), int(match.group(1)))
    return out


def check_save_id(metadata: Metadata, common_id: Optional[str], directory: str,
                  common_name: str = "common.pt") -> List[str]:
    """Check that ``.metadata`` and the plain-data file ``common_name`` (holding rank 0's id
    ``common_id``) come from one save.

    Returns:
        the notes to print: one for a checkpoint written before save ids.

    Raises:
        CheckpointFormatError: naming both files and the ids when they differ.
    """
    ids = {rank: save_id for _, save_id, rank in save_ids(metadata).values()}
    meta = os.path.join(directory, METADATA_FILE)
    if not ids and common_id is None:
        return [f"{directory} was written before per-save ids: its data files are not checked "
                "against its .metadata (save it again to have them checked)"]
    if ids.get(0) != common_id:
        raise CheckpointFormatError(
            f"{os.path.join(directory, common_name)} and {meta} come from different saves (save "
            f"id {common_id} vs {ids.get(0)}): the folder mixes files of two checkpoints; "
            "restore it, or resume from another checkpoint")
    return []


# Loading ----------------------------------------------------------------------------------------

class _Reader(FileSystemReader):
    """``FileSystemReader`` with the safe metadata reader (the metadata read before, passed in),
    and each stored record read once (``torch.load(weights_only=True)``) for all the wanted
    boxes that overlap it."""

    def __init__(self, directory: str, metadata: Metadata):
        super().__init__(directory)
        self._metadata = metadata
        self._ids = save_ids(metadata)

    def _open(self, relative_path: str):
        """Open a data file; with save ids, check first that it comes from this save."""
        path = os.path.join(str(self.path), relative_path)
        f = open(path, "rb")
        if not self._ids:
            return f
        try:
            if relative_path not in self._ids:
                raise CheckpointFormatError(f"{path} has no save id although {METADATA_FILE} "
                                            "gives every data file one")
            index, expected, _ = self._ids[relative_path]
            info = self.storage_data[index]
            f.seek(info.offset)
            data = f.read(info.length)
            try:
                found = bytes(_load_record(data, path, index, info.offset).numpy()).decode("ascii")
            except (CheckpointFormatError, UnicodeDecodeError, TypeError, ValueError):
                found = "unreadable"
            if found != expected:
                raise CheckpointFormatError(
                    f"{path} comes from another save than {os.path.join(str(self.path), METADATA_FILE)} "
                    f"(save id {found}, expected {expected}): the folder mixes files of two "
                    "checkpoints; restore it, or resume from another checkpoint")
        except BaseException:
            f.close()
            raise
        return f

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's per-rank fallback: we never write those
            raise CheckpointFormatError("no per-rank metadata")
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        by_record: Dict[MetadataIndex, list] = {}
        for item in plan.items:
            by_record.setdefault(item.storage_index, []).append(item)
        records = sorted(by_record, key=lambda i: (self.storage_data[i].relative_path,
                                                   self.storage_data[i].offset))
        handles = {}
        try:
            for index in records:
                info = self.storage_data[index]
                f = handles.get(info.relative_path)
                if f is None:
                    f = handles[info.relative_path] = self._open(info.relative_path)
                f.seek(info.offset)
                data = f.read(info.length)
                if len(data) != info.length:
                    raise CheckpointFormatError(
                        f"{os.path.join(str(self.path), info.relative_path)} ends before the "
                        f"record of {index.fqn} (byte {info.offset + info.length}): truncated.")
                stored = _load_record(data, os.path.join(str(self.path), info.relative_path),
                                      index, info.offset)
                for item in by_record[index]:
                    part = stored
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        part = part.narrow(dim, start, length)
                    planner.resolve_tensor(item).copy_(part)
        finally:
            for f in handles.values():
                f.close()
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


def _load_record(data: bytes, path: str, index: MetadataIndex, offset: int) -> torch.Tensor:
    """One stored box: its CRCs checked (:mod:`megatron.core.dist_checkpointing.checkpoint_io`), then
    ``torch.load(weights_only=True)``."""
    from megatron.core.dist_checkpointing.checkpoint_io import (UnreadableFileError,
                                                              verify_bytes_checksums)

    name = f"{path} (the record of {index.fqn} at byte {offset})"
    try:
        verify_bytes_checksums(data, name, "distributed checkpoint data")
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except UnreadableFileError as exc:
        raise CheckpointFormatError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a refused or damaged pickle
        raise CheckpointFormatError(
            f"cannot read distributed checkpoint data {name}: {type(exc).__name__}; it is "
            "damaged, or holds objects other than tensors (refused: nothing in it ran)") from None
    if not isinstance(value, torch.Tensor):
        raise CheckpointFormatError(f"{name} holds a {type(value).__name__}, not a tensor")
    return value


class _LoadPlanner(LoadPlanner):
    """Reads into the given boxes (``dest_index.index`` is the box's position in the list)."""

    def __init__(self, tensors: Sequence[ShardedTensor]):
        self._targets = list(tensors)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for i, t in enumerate(self._targets):
            md = self.metadata.state_dict_metadata[t.key]
            chunk = ChunkStorageMetadata(offsets=torch.Size(t.global_offset),
                                         sizes=torch.Size(t.data.shape))
            reads = create_read_items_for_chunk_list(t.key, md, [chunk])
            covered = sum(math.prod(r.lengths) for r in reads)
            if covered != t.data.numel():
                raise CheckpointFormatError(
                    f"{t.key}: the checkpoint holds {covered} of the {t.data.numel()} elements of "
                    f"the box at {list(t.global_offset)} of shape {list(t.data.shape)}")
            items += [dataclasses.replace(r, dest_index=dataclasses.replace(r.dest_index, index=i))
                      for r in reads]
        return LoadPlan(items)

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointFormatError(f"{read_item.dest_index.fqn}: pickled objects in a "
                                    "distributed checkpoint are not read")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        box = self._targets[read_item.dest_index.index].data
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            box = box.narrow(dim, start, length)
        return box

    def commit_tensor(self, read_item, tensor) -> None:
        pass


def check_fits(tensors: Sequence[ShardedTensor], metadata: Metadata,
               directory: str) -> List[ShardedTensor]:
    """The boxes to read: each checked against the checkpoint's keys and global shapes;
    resizable ones (padded vocabularies) clipped to the rows saved, those outside them dropped.

    Raises:
        CheckpointFormatError: a key missing from the checkpoint, or a global shape that differs
            (names the key and both shapes).
    """
    saved = tensor_shapes(metadata)
    out = []
    for t in tensors:
        if t.key not in saved:
            near = sorted(k for k in saved if k.split(".")[0] == t.key.split(".")[0])[:3]
            raise CheckpointFormatError(
                f"{directory} holds no tensor {t.key} (it holds e.g. {near}): the checkpoint "
                "was saved from another model or without this state")
        shape = saved[t.key][0]
        if t.resizable and shape[1:] == t.global_shape[1:] and shape[0] != t.global_shape[0]:
            t = t.clipped_rows(shape[0])
            if t is None:
                continue
        if shape != tuple(t.global_shape):
            raise CheckpointFormatError(
                f"{directory}: tensor {t.key} has global shape {list(shape)} in the checkpoint but "
                f"{list(t.global_shape)} in the model; the model flags (sizes, vocabulary) must "
                "match the run that saved it")
        out.append(t)
    return out


def load(tensors: Sequence[ShardedTensor], directory: str, *, process_group=None,
         metadata: Optional[Metadata] = None, single_process: bool = False) -> None:
    """Fill this rank's boxes in place from the checkpoint in ``directory``, whatever layout saved
    it. Collective over ``process_group`` (see :func:`save`).

    Args:
        tensors: the boxes wanted (replicas included); checked by :func:`check_fits`.
        metadata: the folder's :func:`read_metadata`, if already read.
        single_process: read in this process alone, without collectives (a tool, or a rank
            reading on its own).

    Raises:
        CheckpointFormatError: see :func:`check_fits` and :func:`read_metadata`; a record that
            cannot be read (truncated, refused), on every rank.
    """
    metadata = metadata or read_metadata(directory)
    wanted = check_fits(tensors, metadata, directory)
    try:
        with _single_process_quiet():
            dcp.load({}, storage_reader=_Reader(directory, metadata), planner=_LoadPlanner(wanted),
                     process_group=process_group,
                     no_dist=single_process or not dist.is_initialized())
    except CheckpointException as exc:
        rank, cause = _first_failure(exc)
        if isinstance(cause, CheckpointFormatError):
            raise CheckpointFormatError(str(cause)) from None
        raise CheckpointFormatError(f"rank {rank} could not read {directory}: "
                                    f"{type(cause).__name__}: {cause}") from None
