"""The DPO reference table saved with the run, so that a preempted DPO run resumes exactly.

A fresh DPO run (``--load REFERENCE --finetune``, or no ``--load``) computes the reference
log-probabilities once before training (:meth:`megatron.training.dpo.DPO.reference_pass`). One
rank (the last pipeline stage's tensor- and data-parallel rank 0, which holds the filled table)
writes them, atomically (a temporary file, then ``os.replace``), to ``{--save}/dpo_reference.npz``,
beside the checkpoint folders and the tracker, so the file serves both checkpoint formats
(``torch_dist`` and legacy) and every checkpoint of the run. A resumed run (``--load`` of that
save, no ``--finetune``) reads the table instead of recomputing it from its partly trained weights.

Format: a NumPy ``.npz`` read with ``allow_pickle=False`` (nothing in it runs):

- ``table``: ``[documents, 2]`` float32, the reference sequence log-probabilities (chosen,
  rejected) per pair document (zeros for pairs not computed);
- ``pairs``: ``[n]`` int64, the sorted document indices of the pairs computed (the run's train,
  validation and test samples);
- ``meta``: a 0-d unicode array, JSON: ``reference_load`` (the real path of the reference
  checkpoint's ``--load``, or null for initial weights), ``reference_iteration`` (the iteration
  loaded from it, 0 for none), ``data_path`` (the real path of the ``_chosen_document`` prefix),
  ``documents``, ``seq_length``, ``length_normalization`` and ``vocab_size`` (the tokenizer's).

A resumed run refuses (one line, exit 2) a missing file, or one whose ``data_path``,
``documents``, ``seq_length``, ``length_normalization`` or ``vocab_size`` differ from its own, or
that lacks a pair the resumed run reads; and a ``--load`` with the table but no checkpoint
(:func:`megatron.training.dpo.check_dpo_flags`).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Optional

import numpy as np

from megatron.usage_error import UsageError

REFERENCE_FILE = "dpo_reference.npz"
CHECKED = ("data_path", "documents", "seq_length", "length_normalization", "vocab_size")


def reference_file(folder: str) -> str:
    """The table's path in a ``--save`` / ``--load`` folder."""
    return os.path.join(folder, REFERENCE_FILE)


def run_meta(config, documents: Optional[int], vocab_size: Optional[int]) -> dict:
    """What this run's table is (or must be) computed from; ``documents`` None: not yet known."""
    return {"data_path": os.path.realpath(str(config.data.data_path[0])),
            "documents": documents, "seq_length": int(config.data.seq_length),
            "length_normalization": bool(config.extra["dpo"].dpo_length_normalization),
            "vocab_size": None if vocab_size is None else int(vocab_size)}


def save_reference(folder: str, table: np.ndarray, pairs: np.ndarray, meta: dict) -> str:
    """Write the table atomically to ``{folder}/dpo_reference.npz``; returns the path."""
    path = reference_file(folder)
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        np.savez(f, table=np.asarray(table, dtype=np.float32),
                 pairs=np.asarray(pairs, dtype=np.int64), meta=np.array(json.dumps(meta)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    return path


_META_MAX_BYTES = 2 ** 20  # the meta JSON string, in bytes of numpy's UTF-32 storage


def _header(npz, key: str) -> tuple:
    """``(shape, dtype)`` of the array ``key`` of an open ``.npz``, read from its ``.npy`` header
    alone (numpy's format: magic, version, header dict).

    Raises:
        KeyError: no such array; ValueError: a header numpy cannot read.
    """
    with npz.zip.open(f"{key}.npy") as member:
        version = np.lib.format.read_magic(member)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"{key}.npy is of .npy format version {version}, not 1.0 or 2.0")
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, _fortran, dtype = read(member)
    return shape, dtype


def read_reference(folder: str, expected: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(table [documents, 2] float32, pairs [n] int64, meta)`` of ``{folder}/dpo_reference.npz``
    after checking it fits ``expected`` (:func:`run_meta`; keys that are None are not checked).

    Raises:
        UsageError: the file is missing, no regular file (a named pipe, a folder, a device, a
            broken link: never read, a pipe would wait for a writer forever) or unreadable, or a
            :data:`CHECKED` value differs.
    """
    from megatron.checkpointing.save_folder import file_kind

    path = reference_file(folder)
    fix = ("resume from the --save folder of the DPO run that wrote it with that run's flags, or "
           "start afresh with --load REFERENCE_CHECKPOINT --finetune")
    resumes = f"--load {folder} without --finetune resumes a DPO run, but its reference table"
    if not os.path.lexists(path):
        raise UsageError(f"{resumes} {path} is missing; {fix}")
    if not os.path.isfile(path):  # stat only: nothing is opened
        raise UsageError(f"{resumes} {path} is a {file_kind(path)}, not a regular file; "
                         f"remove it, then {fix}")
    try:
        # Non-blocking, then checked again on the open file: one swapped for a pipe after the
        # check above is refused, not waited on.
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as raw:
            if not stat.S_ISREG(os.fstat(raw.fileno()).st_mode):
                raise UsageError(f"{resumes} {path} is not a regular file; remove it, then {fix}")
            with np.load(raw, allow_pickle=False) as f:
                # Every array's header is checked before it is read: a crafted header would
                # otherwise have numpy allocate what it claims (terabytes).
                if _header(f, "meta")[0] != () or _header(f, "meta")[1].kind != "U" or \
                        _header(f, "meta")[1].itemsize > _META_MAX_BYTES:
                    raise ValueError("its meta is not one short string")
                meta = json.loads(str(f["meta"]))
                documents = meta.get("documents") if isinstance(meta, dict) else None
                if type(documents) is not int or documents < 0:
                    raise ValueError("its meta is not a JSON object with a document count")
                if _header(f, "table") != ((documents, 2), np.dtype(np.float32)):
                    raise ValueError(f"table is {_header(f, 'table')}, expected ({documents}, 2) "
                                     "float32")
                shape, dtype = _header(f, "pairs")
                if len(shape) != 1 or shape[0] > documents or dtype != np.int64:
                    raise ValueError(f"pairs is {shape} {dtype}, expected at most {documents} int64")
                table, pairs = f["table"], f["pairs"]
    except UsageError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise UsageError(f"{path}: not a DPO reference table ({type(exc).__name__}: "
                         f"{str(exc)[:300]}); {fix}") from None
    for key in CHECKED:
        if expected.get(key) is not None and meta.get(key) != expected[key]:
            flag = {"data_path": "--data-path", "seq_length": "--seq-length",
                    "length_normalization": "--dpo-length-normalization",
                    "documents": "the pair count of --data-path",
                    "vocab_size": "the tokenizer's vocabulary size"}[key]
            raise UsageError(f"{path}: the DPO reference table was computed for {flag} "
                             f"{meta.get(key)}, this run has {expected[key]}; {fix}")
    if table.shape != (meta["documents"], 2) or table.dtype != np.float32:
        raise UsageError(f"{path}: table of shape {table.shape} {table.dtype}, expected "
                         f"({meta['documents']}, 2) float32; {fix}")
    return table, pairs, meta


def check_pairs(folder: str, stored: np.ndarray, needed: np.ndarray) -> None:
    """Refuse a resumed run that reads pairs the saved table does not hold.

    Raises:
        UsageError: naming the count and the first missing pair.
    """
    missing = np.setdiff1d(needed, stored)
    if missing.size:
        raise UsageError(
            f"{reference_file(folder)}: the resumed DPO run reads {missing.size} preference pairs "
            f"the reference table does not hold (first: document {int(missing[0])}); resume with "
            "the --train-iters, --split, --eval-iters and --seed of the run that wrote it, or "
            "start afresh with --load REFERENCE_CHECKPOINT --finetune")
