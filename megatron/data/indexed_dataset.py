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
"document" is one or more consecutive sequences (the preprocessor writes one sequence per document
unless sentences are split). No torch import: the preprocessor and the datasets start fast.
"""

from __future__ import annotations

import os
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


def dtype_code(dtype) -> int:
    """Returns the MMIDIDX header code of a numpy dtype.

    Raises:
        ValueError: the dtype has no code in the format.
    """
    dtype = np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} cannot be stored in an MMIDIDX dataset; use one of "
                     f"{sorted(np.dtype(d).name for d in DTYPES.values())}")


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

    Raises:
        IndexedDatasetError: a file is missing, the magic, version or dtype code is wrong, the
            ``.idx`` length does not match its header, the document indices are not an increasing
            walk from 0 to ``S``, or a sequence lies beyond the end of the ``.bin``; the message
            names the file and the problem.
    """

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"{path}: file not found; expected the pair {bin_path} / {idx_path} written by "
                    "tools/preprocess_data.py (pass the prefix without .bin/.idx)")
        self._index = _read_index(idx_path)
        self.dtype, self.sizes, self.pointers, self.document_indices = self._index
        self._bin_size = os.path.getsize(bin_path)
        _check_fits(bin_path, idx_path, self._bin_size, self.sizes, self.pointers, self.dtype.itemsize)
        # np.memmap refuses empty files; an empty dataset needs no map.
        self._bin = (np.memmap(bin_path, dtype=np.uint8, mode="r") if self._bin_size
                     else np.zeros(0, dtype=np.uint8))

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


def _check_fits(bin_path: str, idx_path: str, bin_size: int, sizes, pointers, itemsize: int) -> None:
    if len(sizes) == 0:
        return
    if sizes.min() < 0 or pointers.min() < 0:
        raise IndexedDatasetError(f"{idx_path}: negative sizes or pointers; the index is corrupted")
    ends = pointers + sizes.astype(np.int64) * itemsize
    last = int(ends.max())
    if last > bin_size:
        bad = int(np.argmax(ends > bin_size))
        raise IndexedDatasetError(
            f"{bin_path}: {bin_size} bytes, but sequence {bad} of {idx_path} ends at byte {int(ends[bad])} "
            f"(the index needs {last} bytes); the .bin is truncated or the pair does not belong together")


class MMapIndexedDatasetBuilder:
    """Writes an MMIDIDX pair; both files appear under their final names only in ``finalize``.

    Tokens go to ``{bin_path}.tmp-{pid}`` as they come; ``finalize`` writes the index the same way
    and renames the ``.bin`` and then the ``.idx`` (the index is the commit point), so an
    interrupted run leaves no half-written dataset under the final names. ``abort()`` (or leaving a
    ``with`` block by an exception) removes the temporary files.

    Args:
        bin_path: final path of the ``.bin`` file.
        dtype: numpy dtype of the token ids (``best_fitting_dtype(vocab_size)``).
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.bin_path = bin_path
        self._tmp_bin = _tmp_path(bin_path)
        self._file = open(self._tmp_bin, "wb")
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
        """Appends one document made of ``len(lengths)`` sequences laid out back to back in ``tokens``."""
        arr = np.asarray(tokens, dtype=self.dtype).reshape(-1)
        if sum(int(n) for n in lengths) != arr.size:
            raise ValueError(f"add_document: lengths {list(lengths)} do not sum to the {arr.size} tokens given")
        self._file.write(arr.tobytes(order="C"))
        self.sizes.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sizes))

    def add_documents(self, flat_tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Appends many one-sequence documents at once (the preprocessor's fast path).

        Args:
            flat_tokens: 1-D array, the documents' tokens back to back (cast to ``dtype``).
            lengths: 1-D integer array, tokens of each document.
        """
        flat = np.ascontiguousarray(flat_tokens, dtype=self.dtype).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != flat.size:
            raise ValueError(f"add_documents: lengths sum to {int(lengths.sum())}, tokens given {flat.size}")
        self._file.write(memoryview(flat).cast("B"))
        start = len(self.sizes)
        self.sizes.frombytes(lengths.astype(np.int32).tobytes())
        self.document_indices.frombytes(np.arange(start + 1, start + 1 + lengths.size, dtype=np.int64).tobytes())

    def add_index(self, path_prefix: str) -> None:
        """Appends a whole existing dataset (its tokens, sequences and document boundaries).

        Raises:
            ValueError: its dtype differs from this builder's, or its ``.bin`` is not laid out back
                to back (as every MMIDIDX writer does).
        """
        other = MMapIndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{path_prefix}: token dtype {other.dtype} differs from the merged "
                             f"dataset's {self.dtype}; all inputs of a merge need the same dtype")
        nbytes = int(other.sizes.sum(dtype=np.int64)) * self.dtype.itemsize
        contiguous = np.zeros(len(other), dtype=np.int64)
        np.cumsum(other.sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=contiguous[1:])
        if other._bin_size != nbytes or not np.array_equal(other.pointers, contiguous):
            raise ValueError(f"{path_prefix}: its sequences are not stored back to back in the .bin "
                             f"({other._bin_size} bytes for {nbytes} bytes of tokens); cannot append it")
        offset = len(self.sizes)
        self.sizes.frombytes(np.ascontiguousarray(other.sizes).tobytes())
        self.document_indices.frombytes((other.document_indices[1:] + offset).astype(np.int64).tobytes())
        with open(data_file_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._file, length=16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Writes the index and moves both files to their final names."""
        self._file.close()
        sizes = np.frombuffer(self.sizes, dtype=np.int32) if len(self.sizes) else np.zeros(0, np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        # int64 byte offsets: a merged dataset beyond 2**31 tokens stays correct.
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_indices = np.frombuffer(self.document_indices, dtype=np.int64)
        tmp_idx = _tmp_path(idx_path)
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, _VERSION, self._code, len(sizes), len(doc_indices)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_indices.tobytes(order="C"))
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, idx_path)

    def abort(self) -> None:
        """Closes and deletes the temporary ``.bin``; the final names are left untouched."""
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False
