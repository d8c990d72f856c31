"""Megatron's memory-mapped indexed dataset (``.bin`` + ``.idx``, format "MMIDIDX").

Byte-compatible with ``megatron/core/datasets/indexed_dataset.py`` of NVIDIA Megatron-LM (and the
older ``megatron/data/indexed_dataset.py`` "mmap" implementation of Megatron-LLaMA): files written
here load in Megatron-LM unchanged and the other way round.

``.idx`` layout (all little-endian, no padding)::

    offset  field
    0       magic             9 bytes  b"MMIDIDX\\x00\\x00"
    9       version           <Q       1
    17      dtype code        <B       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                       6 float64, 7 float32, 8 uint16
    18      sequence count S  <Q
    26      document count D  <Q       entries of ``document_indices`` (number of documents + 1)
    34      sizes             int32[S] tokens per sequence
            pointers          int64[S] byte offset of each sequence in the ``.bin``
            document_indices  int64[D] sequence index where each document starts, then S

The ``.bin`` holds the token ids of all sequences back to back in the dtype of the header. A
"document" is zero or more consecutive sequences: the preprocessor writes one sequence per
document unless sentences are split, and none for a document that tokenizes to nothing (its entry
in ``document_indices`` repeats the previous one, as Megatron-LM's ``add_document([], [])``
writes). No torch import: the preprocessor and the datasets start fast.

Opening a pair validates it from the ``.idx`` alone, never by reading the ``.bin``: magic,
version, an integer dtype code, the ``.idx`` length against its header, document indices rising
from 0 to ``S``, pointers equal to the running sum of ``sizes x item size`` (what every writer
writes; int32 data behind a uint16 header fails it) and the ``.bin`` length equal to their end.
The check reads the index in blocks (bounded memory; 0.2 s for 10^7 sequences here).

Writers put both files under temporary names ``{final}.tmp-{pid}``, each held under an exclusive
``flock`` while it is written, and rename them at the end (see
:class:`MMapIndexedDatasetBuilder`); a later writer of the same names deletes temporaries whose
lock is free (their writer is gone) and refuses to start while one is held.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import re
import shutil
import struct
from array import array
from typing import Iterable, Optional, Sequence, Union

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
# Token ids are integers: the float codes of the format are refused for reading and writing.
TOKEN_DTYPES = {code: dt for code, dt in DTYPES.items() if np.issubdtype(dt, np.integer)}
_CHECK_BLOCK = 1 << 20  # sequences per block of the layout check

logger = logging.getLogger(__name__)


def dtype_code(dtype) -> int:
    """Returns the MMIDIDX header code of a numpy dtype.

    Raises:
        ValueError: the dtype has no code in the format.
    """
    dtype = np.dtype(dtype)
    for code, candidate in TOKEN_DTYPES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} cannot hold token ids in an MMIDIDX dataset; use one of "
                     f"{sorted(np.dtype(d).name for d in TOKEN_DTYPES.values())}")


def best_fitting_dtype(vocab_size: Optional[int]) -> type:
    """Token dtype of Megatron's rule (``DType.optimal_dtype``): uint16 below 65,500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(path_prefix: str) -> str:
    """``{prefix}.bin``."""
    return path_prefix + ".bin"


def index_file_path(path_prefix: str) -> str:
    """``{prefix}.idx``."""
    return path_prefix + ".idx"


def _tmp_path(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


class _LockedFile:
    """A file opened for writing under an exclusive ``flock``, held until ``close``."""

    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "wb")
        fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()  # releases the lock


def remove_stale_temporaries(path: str) -> int:
    """Deletes ``{path}.tmp-{pid}`` files of writers that are gone; returns how many.

    A temporary is provably a leftover of this module when its name has that exact form and its
    ``flock`` can be taken (the lock dies with its writer, whatever the kill).

    Raises:
        FileExistsError: another live process is writing ``path`` (its lock is held).
    """
    pattern = re.compile(re.escape(os.path.basename(path)) + r"\.tmp-\d+")
    removed = 0
    for leftover in glob.glob(glob.escape(path) + ".tmp-*"):
        if not pattern.fullmatch(os.path.basename(leftover)):
            continue
        try:
            with open(leftover, "rb") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.remove(leftover)  # under our lock: no writer can be starting on it
        except BlockingIOError:
            raise FileExistsError(f"{leftover}: another process is writing {path} right now; "
                                  "wait for it to finish, or write to another output") from None
        except FileNotFoundError:
            continue
        removed += 1
        logger.warning("removed %s, left by an interrupted run", leftover)
    return removed


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, truncated, corrupted or mismatched."""


class MMapIndexedDataset:
    """Read-only view of a ``{path_prefix}.bin/.idx`` pair through memory maps.

    Neither file is read into memory: arrays are numpy views of the mapped files, so reading a
    dataset costs page cache, not anonymous memory, whatever its size.

    Args:
        path_prefix: path without the ``.bin``/``.idx`` suffix.

    Attributes:
        sizes: int32 ``[S]``, tokens per sequence (Megatron's ``sequence_lengths``).
        pointers: int64 ``[S]``, byte offset of each sequence in the ``.bin``.
        document_indices: int64 ``[D]``, first sequence of each document, then ``S``.
        dtype: numpy dtype of the token ids.

        num_tokens: tokens in the whole dataset (from the index).

    Raises:
        IndexedDatasetError: a file is missing, the magic, version or dtype code is wrong (or
            not an integer type), the ``.idx`` length does not match its header, the document
            indices are not a non-decreasing walk from 0 to ``S``, the pointers are not the
            running sum of the sizes in bytes, or the ``.bin`` length differs from their end;
            the message names the file and the problem.
    """

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                what = "file not found"
                if os.path.lexists(path):  # named from stat alone: a pipe is never opened
                    from megatron.file_kinds import file_kind

                    what = f"a {file_kind(path)}, not a regular file (it was not opened)"
                raise IndexedDatasetError(
                    f"{path}: {what}; expected the pair {bin_path} / {idx_path} written by "
                    "tools/preprocess_data.py (pass the prefix without .bin/.idx)")
        self._index = _read_index(idx_path)
        self.dtype, self.sizes, self.pointers, self.document_indices = self._index
        self._bin_size = os.path.getsize(bin_path)
        self.num_tokens = _check_layout(bin_path, idx_path, self._bin_size, self.sizes, self.pointers,
                                        self.dtype)
        self._bin_inode = os.stat(bin_path).st_ino
        # np.memmap refuses empty files; an empty dataset needs no map.
        self._bin = (np.memmap(bin_path, dtype=np.uint8, mode="r") if self._bin_size
                     else np.zeros(0, dtype=np.uint8))

    def check_not_truncated(self, end: int) -> None:
        """Refuse to read up to byte ``end`` of the ``.bin`` when the file no longer reaches it
        (truncated in place while this job runs: touching the mapped pages past its new end
        would kill the process with SIGBUS). One ``stat``; a file removed or replaced by another
        one (a new inode) leaves the mapped old one intact and is not refused.

        Raises:
            IndexedDatasetError: naming the file, its size now and the size the index needs.
        """
        path = data_file_path(self.path_prefix)
        try:
            now = os.stat(path)
        except FileNotFoundError:  # removed: the mapped inode lives on until unmapped
            return
        if now.st_ino == self._bin_inode and now.st_size < end:
            raise IndexedDatasetError(
                f"{path}: truncated while this job runs: {now.st_size} bytes now, {self._bin_size} "
                f"when opened, and {index_file_path(self.path_prefix)} needs {end}; restore the "
                "file (or re-run tools/preprocess_data.py) and resume from the last checkpoint")

    def token_range(self, limit_bytes: int) -> Optional[tuple]:
        """``(lowest, highest)`` token id of the whole ``.bin``, read in blocks of 16 MiB, or
        None when the file is larger than ``limit_bytes`` (too long to read at start) or
        empty."""
        if not self._bin_size or self._bin_size > limit_bytes:
            return None
        tokens = np.frombuffer(self._bin, dtype=self.dtype)
        block = (16 << 20) // self.dtype.itemsize
        low, high = None, None
        for start in range(0, len(tokens), block):
            part = tokens[start:start + block]
            lo, hi = int(part.min()), int(part.max())
            low = lo if low is None else min(low, lo)
            high = hi if high is None else max(high, hi)
        return low, high

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, idx: Union[int, slice]):
        """Sequence ``idx`` as a read-only 1-D array of ``dtype``; a slice gives a list of them."""
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if ``length`` is None).

        Raises:
            IndexError: ``idx`` or the token range lies outside the dataset.
            IndexedDatasetError: the ``.bin`` was truncated since it was opened
                (:meth:`check_not_truncated`).
        """
        n = len(self)
        idx = int(idx)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self.path_prefix}")
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                             f"of {size} tokens in {self.path_prefix}")
        start = int(self.pointers[idx]) + offset * self.dtype.itemsize
        if length:
            self.check_not_truncated(start + length * self.dtype.itemsize)
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start) if length \
            else np.zeros(0, dtype=self.dtype)

    @property
    def doc_idx(self) -> np.ndarray:
        """Megatron-LLaMA's name of ``document_indices``."""
        return self.document_indices

    @property
    def sequence_lengths(self) -> np.ndarray:
        """Megatron-Core's name of ``sizes``."""
        return self.sizes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Both files of the pair are present."""
        return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(data_file_path(path_prefix))


IndexedDataset = MMapIndexedDataset


def _read_index(idx_path: str):
    file_size = os.path.getsize(idx_path)
    if file_size < _HEADER.size:
        raise IndexedDatasetError(f"{idx_path}: truncated; {file_size} bytes is shorter than the "
                                  f"{_HEADER.size}-byte MMIDIDX header")
    with open(idx_path, "rb") as f:
        magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(_HEADER.size))
    if magic != _MAGIC:
        raise IndexedDatasetError(f"{idx_path}: not an MMIDIDX index (magic {magic!r}, expected "
                                  f"{_MAGIC!r}); the legacy 'cached'/'lazy' formats are not supported")
    if version != _VERSION:
        raise IndexedDatasetError(f"{idx_path}: unsupported MMIDIDX version {version} (expected 1)")
    if code not in DTYPES:
        raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code} (valid: 1-8)")
    if code not in TOKEN_DTYPES:
        raise IndexedDatasetError(f"{idx_path}: dtype code {code} ({np.dtype(DTYPES[code]).name}) is "
                                  "not an integer type, so the .bin cannot hold token ids; the index "
                                  "is corrupted or not a token dataset (re-run tools/preprocess_data.py)")
    expected = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if file_size != expected:
        raise IndexedDatasetError(
            f"{idx_path}: file has {file_size} bytes but its header ({n_seq} sequences, {n_doc} "
            f"document indices) needs {expected}; the index is truncated or corrupted")
    idx_map = np.memmap(idx_path, dtype=np.uint8, mode="r") if expected > _HEADER.size else None
    offset = _HEADER.size

    def view(dtype, count):
        nonlocal offset
        arr = np.frombuffer(idx_map, dtype=dtype, count=count, offset=offset) if count \
            else np.zeros(0, dtype=dtype)
        offset += count * np.dtype(dtype).itemsize
        return arr

    sizes, pointers, doc_indices = view(np.int32, n_seq), view(np.int64, n_seq), view(np.int64, n_doc)
    if n_doc < 1 or doc_indices[0] != 0 or doc_indices[-1] != n_seq or np.any(np.diff(doc_indices) < 0):
        raise IndexedDatasetError(
            f"{idx_path}: document indices must rise from 0 to the sequence count {n_seq}; got "
            f"{n_doc} entries starting {doc_indices[:3].tolist()} ending {doc_indices[-3:].tolist()}")
    return np.dtype(DTYPES[code]), sizes, pointers, doc_indices


def _check_layout(bin_path: str, idx_path: str, bin_size: int, sizes: np.ndarray,
                  pointers: np.ndarray, dtype: np.dtype) -> int:
    """Pointers are the running sum of ``sizes x itemsize`` from 0 and the ``.bin`` ends there;
    returns the number of tokens. Reads the index in blocks of ``_CHECK_BLOCK`` sequences.

    Each block's first pointer must equal the end so far (at most the ``.bin`` size) and its
    differences the sizes in bytes; a block adds under 2**55 bytes, so no sum reaches 2**63.
    """
    itemsize, end = dtype.itemsize, 0
    for start in range(0, len(sizes), _CHECK_BLOCK):
        block = sizes[start:start + _CHECK_BLOCK]
        if block.min() < 0:
            bad = start + int(np.argmax(block < 0))
            raise IndexedDatasetError(f"{idx_path}: sequence {bad} has negative size {int(sizes[bad])}; "
                                      "the index is corrupted")
        nbytes = np.multiply(block, itemsize, dtype=np.int64)
        got = pointers[start:start + len(block)]
        steps = np.diff(got)
        if got[0] != end or not np.array_equal(steps, nbytes[:-1]):
            i = 0 if got[0] != end else 1 + int(np.argmax(steps != nbytes[:-1]))
            expected = end if i == 0 else int(got[i - 1]) + int(nbytes[i - 1])
            raise IndexedDatasetError(
                f"{idx_path}: sequence {start + i} starts at byte {int(got[i])} of the .bin, but "
                f"the sizes before it ({dtype.name}, {itemsize} bytes per token) put it at byte "
                f"{expected}; the index is corrupted or its dtype does not match the data (re-run "
                "tools/preprocess_data.py)")
        end = int(got[-1]) + int(nbytes[-1])
        if end > bin_size:  # already too long; stopping here also keeps the sums far from 2**63
            break
    if end != bin_size:
        raise IndexedDatasetError(
            f"{bin_path}: {bin_size} bytes, but {idx_path} describes {end // itemsize} tokens of "
            f"{dtype.name} ({end} bytes); the .bin is {'truncated' if bin_size < end else 'longer'}, "
            "or the pair does not belong together")
    return end // itemsize


def write_index(file, dtype, sizes: np.ndarray, document_indices: np.ndarray) -> None:
    """Writes an ``.idx`` for sequences of ``sizes`` tokens stored back to back in the ``.bin``.

    Args:
        file: a binary file open for writing.
        dtype: token dtype of the ``.bin`` (an integer type).
        sizes: int32 ``[S]``, tokens per sequence.
        document_indices: int64 ``[D]``, the first sequence of each document, then ``S``.
    """
    dtype = np.dtype(dtype)
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    document_indices = np.ascontiguousarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    # int64 byte offsets: a merged dataset beyond 2**31 tokens stays correct.
    np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    file.write(_HEADER.pack(_MAGIC, _VERSION, dtype_code(dtype), len(sizes), len(document_indices)))
    file.write(sizes.tobytes(order="C"))
    file.write(pointers.tobytes(order="C"))
    file.write(document_indices.tobytes(order="C"))


def _index_path_of(bin_path: str) -> str:
    """The ``.idx`` beside a ``.bin`` path (the same name with the other extension)."""
    return (bin_path[:-len(".bin")] if bin_path.endswith(".bin") else bin_path) + ".idx"


class MMapIndexedDatasetBuilder:
    """Writes an MMIDIDX pair; both files appear under their final names only in ``finalize``.

    Tokens go to ``{bin_path}.tmp-{pid}`` as they come, under an exclusive ``flock``; ``finalize``
    writes the index the same way, deletes an older ``.idx`` of that name (so an older ``.bin``
    never pairs with the new index or the other way round), then renames the ``.bin`` and last the
    ``.idx`` (the commit point). A run killed at any point therefore leaves either the complete
    new pair or no loadable pair under the final names, plus temporaries that the next writer of
    the same names deletes (:func:`remove_stale_temporaries`). ``abort()`` (or leaving a ``with``
    block by an exception) removes the temporary files at once.

    Args:
        bin_path: final path of the ``.bin`` file.
        dtype: numpy dtype of the token ids (``best_fitting_dtype(vocab_size)``).

    Raises:
        ValueError: ``dtype`` is not an integer type of the format.
        IndexedDatasetError: the ``.bin`` or ``.idx`` name is a folder.
        FileExistsError: another live process is writing ``bin_path``.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.bin_path = bin_path
        for path in (bin_path, _index_path_of(bin_path)):  # the final rename cannot replace one
            if os.path.isdir(path):
                raise IndexedDatasetError(f"{path} is a folder: the output cannot take its name; "
                                          "move the folder or choose another --output-prefix")
        remove_stale_temporaries(bin_path)
        self._bin = _LockedFile(_tmp_path(bin_path))
        self._file = self._bin.file
        self.sizes = array("i")
        self.document_indices = array("q", [0])

    def add_item(self, tokens: Iterable[int]) -> None:
        """Appends one sequence (a list or 1-D array of token ids)."""
        arr = np.asarray(tokens, dtype=self.dtype).reshape(-1)
        self._file.write(arr.tobytes(order="C"))
        self.sizes.append(arr.size)

    def end_document(self) -> None:
        """Closes the current document after the sequences added since the last call."""
        self.document_indices.append(len(self.sizes))

    def add_document(self, tokens: Iterable[int], lengths: Sequence[int]) -> None:
        """Appends one document made of ``len(lengths)`` sequences laid out back to back in
        ``tokens``; ``([], [])`` is an empty document (no sequence), as in Megatron-LM."""
        arr = np.asarray(tokens, dtype=self.dtype).reshape(-1)
        if sum(int(n) for n in lengths) != arr.size:
            raise ValueError(f"add_document: lengths {list(lengths)} do not sum to the {arr.size} tokens given")
        self._file.write(arr.tobytes(order="C"))
        self.sizes.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sizes))

    def add_documents(self, flat_tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Appends many documents of at most one sequence each (the preprocessor's fast path).

        Equal to ``add_document(tokens, [n])`` per document of ``n > 0`` tokens and
        ``add_document([], [])`` per document of 0 tokens.

        Args:
            flat_tokens: 1-D array, the documents' tokens back to back (cast to ``dtype``).
            lengths: 1-D integer array, tokens of each document (0 for an empty one).
        """
        flat = np.ascontiguousarray(flat_tokens, dtype=self.dtype).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != flat.size or (lengths.size and lengths.min() < 0):
            raise ValueError(f"add_documents: lengths sum to {int(lengths.sum())}, tokens given {flat.size}")
        self._file.write(memoryview(flat).cast("B"))
        start = len(self.sizes)
        nonempty = lengths > 0
        self.sizes.frombytes(lengths[nonempty].astype(np.int32).tobytes())
        self.document_indices.frombytes((start + np.cumsum(nonempty, dtype=np.int64)).tobytes())

    def add_index(self, path_prefix: str) -> None:
        """Appends a whole existing dataset (its tokens, sequences and document boundaries).

        Raises:
            IndexedDatasetError: the pair is damaged (see :class:`MMapIndexedDataset`).
            ValueError: its dtype differs from this builder's.
        """
        other = MMapIndexedDataset(path_prefix)  # validated: back to back, .bin length exact
        if other.dtype != self.dtype:
            raise ValueError(f"{path_prefix}: token dtype {other.dtype} differs from the merged "
                             f"dataset's {self.dtype}; all inputs of a merge need the same dtype")
        offset = len(self.sizes)
        self.sizes.frombytes(np.ascontiguousarray(other.sizes).tobytes())
        self.document_indices.frombytes((other.document_indices[1:] + offset).astype(np.int64).tobytes())
        with open(data_file_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._file, length=16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Writes the index and moves both files to their final names (the ``.idx`` last).

        Raises:
            FileExistsError: another live process is writing ``idx_path``.
        """
        self._file.flush()
        remove_stale_temporaries(idx_path)
        tmp_idx = _LockedFile(_tmp_path(idx_path))
        try:
            sizes = np.frombuffer(self.sizes, dtype=np.int32) if len(self.sizes) else np.zeros(0, np.int32)
            write_index(tmp_idx.file, self.dtype, sizes, np.frombuffer(self.document_indices, dtype=np.int64))
            tmp_idx.file.flush()
            if os.path.lexists(idx_path):
                os.remove(idx_path)
            # Renamed while still open and locked: no other writer's clean-up can take them.
            os.replace(self._bin.path, self.bin_path)
            os.replace(tmp_idx.path, idx_path)
        except BaseException:
            tmp_idx.close()
            if os.path.exists(tmp_idx.path):
                os.remove(tmp_idx.path)
            raise
        finally:
            tmp_idx.close()
            self._bin.close()

    def abort(self) -> None:
        """Closes and deletes the temporary ``.bin``; the final names are left untouched."""
        self._bin.close()
        if os.path.exists(self._bin.path):
            os.remove(self._bin.path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False
