"""On-disk cache of dataset index arrays (``.npy``), keyed by a hash of what they depend on.

Megatron-Core's scheme (``megatron/core/datasets/gpt_dataset.py``): every file of one index set
is named ``{md5(description)}-{Class}-{split}-{array}.npy`` next to a ``...-description.txt``,
where the description is a JSON text of every parameter that affects the arrays. A change of any
parameter changes the name, so a stale set is never picked up.

Unlike Megatron, every file is written under a temporary name and renamed into place
(``os.replace`` is atomic on POSIX), and ``description.txt`` is renamed last: it marks a complete
set. Two jobs writing the same set write identical bytes, so they may race harmlessly, and a
reader never sees a half-written array. A ``...-checksums.json`` (written before the
description) holds each array's dtype, shape and CRC-32; on load the description text must equal
the expected one and every array must match its entry (the caller also checks the shapes it
expects), so a damaged set (a flipped byte, a truncated or replaced file, a missing file) is
logged and rebuilt, never trusted. The CRC reads each array once per load: 0.24 s per 400 MB
here (10^8 samples of a uint32 shuffle index; the sample index of as many samples is twice that).

No torch import: which rank builds and when the others wait is decided by the caller
(``megatron/data/dataset_builder.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zlib
from typing import Dict, Iterable, Optional

import numpy as np

logger = logging.getLogger(__name__)
_WARNED: set = set()  # cache folders whose failed write was reported (once per process)


def describe(fields: dict) -> str:
    """The canonical description text of ``fields`` (JSON, keys in the given order)."""
    return json.dumps(fields, indent=4)


def description_hash(description: str) -> str:
    """md5 hex digest of a description text (Megatron's ``unique_description_hash``)."""
    return hashlib.md5(description.encode("utf-8")).hexdigest()


class IndexCache:
    """One set of cached arrays in ``cache_dir``.

    Args:
        cache_dir: folder of the cache; created on first save.
        kind: class name and split, e.g. ``"GPTDataset-train"``; part of every file name.
        description: the description text (see :func:`describe`) the arrays depend on.
        names: names of the arrays in the set, e.g. ``("document_index", "sample_index")``.
    """

    def __init__(self, cache_dir: str, kind: str, description: str, names: Iterable[str]):
        self.cache_dir = cache_dir
        self.description = description
        self.names = tuple(names)
        self.base = f"{description_hash(description)}-{kind}"

    def path(self, suffix: str) -> str:
        return os.path.join(self.cache_dir, f"{self.base}-{suffix}")

    def load(self) -> Optional[Dict[str, np.ndarray]]:
        """The cached arrays (read-only memory maps), or None when the set is absent or damaged
        (logged as a warning naming the file; the caller rebuilds it)."""
        desc_path = self.path("description.txt")
        if not os.path.isfile(desc_path):
            return None
        try:
            with open(desc_path, "rt", encoding="utf-8") as f:
                if f.read() != self.description:
                    logger.warning("%s: description differs from the expected one; rebuilding", desc_path)
                    return None
            with open(self.path("checksums.json"), "rt", encoding="utf-8") as f:
                expected = json.load(f)
            arrays = {}
            for name in self.names:
                path = self.path(f"{name}.npy")
                arrays[name] = array = np.load(path, mmap_mode="r", allow_pickle=False)
                if _fingerprint(array) != expected.get(name):
                    logger.warning("%s: damaged (dtype, shape or checksum differs from %s); rebuilding",
                                   path, self.path("checksums.json"))
                    return None
            return arrays
        except (OSError, ValueError, TypeError, AttributeError) as err:
            logger.warning("%s: unreadable cached index (%s); rebuilding", self.cache_dir, err)
            return None

    def save(self, arrays: Dict[str, np.ndarray]) -> bool:
        """Write the set atomically; the description goes last and marks it complete.

        A cache that cannot be written (a full disk, a read-only folder) never stops the run: the
        arrays were built in memory and are used from there; one warning per folder and process
        names it and the ``--data-cache-path`` flag, and the next run builds them again.

        Returns:
            True when the set was written.
        """
        try:
            self._save(arrays)
            return True
        except OSError as err:
            if self.cache_dir not in _WARNED:
                _WARNED.add(self.cache_dir)
                logger.warning("cannot write the dataset index cache in %s (%s); the indices are "
                               "used from memory and built again by the next run: pass "
                               "--data-cache-path with a writable folder with free space",
                               self.cache_dir, err)
            return False

    def _save(self, arrays: Dict[str, np.ndarray]) -> None:
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            for name in self.names:
                self._write_atomic(f"{name}.npy", lambda f, a=arrays[name]: np.save(f, a, allow_pickle=False))
            sums = json.dumps({name: _fingerprint(arrays[name]) for name in self.names}, indent=1)
            self._write_atomic("checksums.json", lambda f: f.write(sums.encode("utf-8")))
            self._write_atomic("description.txt", lambda f: f.write(self.description.encode("utf-8")))
        except OSError as err:
            raise OSError(f"cannot write the dataset index cache in {self.cache_dir} ({err}); pass "
                          "--data-cache-path with a writable folder") from err

    def _write_atomic(self, suffix: str, write) -> None:
        final = self.path(suffix)
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=f".{os.path.basename(final)}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def _fingerprint(array: np.ndarray) -> dict:
    """dtype, shape and CRC-32 of the array's bytes (read in 64 MiB blocks)."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    crc = 0
    for start in range(0, flat.size, 64 << 20):
        crc = zlib.crc32(flat[start:start + (64 << 20)], crc)
    return {"dtype": array.dtype.str, "shape": list(array.shape), "crc32": crc}
