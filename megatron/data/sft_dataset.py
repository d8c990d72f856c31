"""Conversations (tokens + loss mask datasets) packed into ``seq_length`` training sequences.

Reads the pair ``tools/preprocess_sft_data.py`` writes (``{prefix}_text_document`` and
``{prefix}_text_loss_mask_document``, one document per conversation) and yields samples of exactly
``seq_length`` positions. A conversation of ``L`` tokens contributes ``L - 1`` positions: inputs
``ids[:-1]``, labels ``ids[1:]``, loss mask ``mask[1:]`` (the loss falls on the assistant tokens as
*labels*); no label ever comes from another conversation.

Packing (``packed=True``): **first-fit decreasing within a shuffle window**. The documents are
shuffled by ``numpy.random.RandomState(seed + epoch)``; each window of ``packing_window``
consecutive documents is sorted by length, longest first, and each goes into the first (oldest)
open sequence with room for it, else opens one (sequences stay open across windows; the 4096
newest are searched). Why: plain first-fit in shuffled order leaves the gaps
that long documents arriving late cannot fill; sorting the whole set would put all long
conversations together at the start of training. A window keeps the order random at the scale of
the window while packing nearly as tight as global FFD (measured in
``benchmarks/sft_packing.py``: :func:`packing_efficiency`). ``packing_window=1`` is first-fit
over the shuffled order.

Unpacked (``packed=False``): one conversation per sample, padded (the reference for "packed
equals unpacked").

Each sample (numpy; ``s`` = ``seq_length``):

- ``tokens`` int64 ``[s]``, ``labels`` int64 ``[s]``, ``loss_mask`` float32 ``[s]`` (0 on padding),
- ``position_ids`` int64 ``[s]``: ``0 .. n-1`` within each document, restarting at each one
  (padding continues from 0 as a segment of its own),
- ``document_ids`` int64 ``[s]``: ``0 .. k-1`` for the sample's ``k`` documents, ``k`` on padding,
- ``cu_seqlens`` int32 ``[s + 1]``: segment boundaries ``0, n_0, n_0 + n_1, ..., s`` (the padding is
  the last segment), then ``-1`` up to the fixed length (so samples stack into a batch); the
  valid entries are those ``>= 0`` (NeMo's padded ``cu_seqlens`` convention),
- ``max_seqlen`` int32 ``[]``: the longest segment.

The keys are those of Megatron-LM's ``SFTDataset`` (``megatron/training/datasets/sft_dataset.py``:
``tokens``, ``labels``, ``loss_mask``, ``position_ids``, ``cu_seqlens``, ``max_seqlen``), plus
``document_ids``; ``cu_seqlens`` is padded to a fixed length here so that samples collate.

A conversation longer than ``seq_length + 1`` tokens is truncated to its first ``seq_length + 1``
(``truncate=True``) or skipped; a truncated one whose kept labels hold no assistant token is
skipped; documents of fewer than 2 tokens are skipped. All are counted in
:attr:`SFTDataset.report`.

Determinism: the packing of every epoch is a function of ``(seed, epoch, documents, lengths)``;
sample ``i`` is the same whatever was read before, so resuming at sample ``i`` is exact.
No torch import.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence

import numpy as np

from megatron.data.index_cache import IndexCache, describe
from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset

_INDEX_FORMAT = 1  # bump when the packing changes, so older caches are never reused
_CACHED = ("sample_offsets", "sample_documents", "samples_per_epoch")


def pack_first_fit(lengths: np.ndarray, capacity: int, window: int, max_open: int = 4096) -> List[List[int]]:
    """Bins (lists of positions into ``lengths``) by first-fit decreasing within windows.

    Args:
        lengths: int ``[N]``, positions each item needs (each ``<= capacity``), in the order to pack.
        capacity: positions per bin.
        window: items sorted longest-first and packed together; 1 is plain first-fit.
        max_open: bins searched for room (the most recently opened ones; older bins are closed),
            which bounds the cost at ``O(N * max_open)`` vectorised steps.

    Returns:
        Bins in the order they were opened; a bin's items in the order they went in. Each item
        goes into the first (oldest) open bin with room, else into a new bin.
    """
    bins: List[List[int]] = []
    free = np.zeros(0, dtype=np.int64)    # room of the open bins, oldest first
    which = np.zeros(0, dtype=np.int64)   # their positions in ``bins``
    for start in range(0, len(lengths), window):
        idx = np.arange(start, min(start + window, len(lengths)))
        # Stable sort: ties keep the shuffled order, so the result is deterministic.
        for i in idx[np.argsort(-lengths[idx], kind="stable")]:
            n = int(lengths[i])
            fits = np.flatnonzero(free >= n)
            if fits.size:
                b = fits[0]
                bins[which[b]].append(int(i))
                free[b] -= n
            else:
                bins.append([int(i)])
                free, which = np.append(free, capacity - n), np.append(which, len(bins) - 1)
            if free.size > max_open or (free.size and free.min() == 0):
                keep = free > 0
                keep[:max(0, int(keep.sum()) - max_open)] = False
                free, which = free[keep], which[keep]
    return bins


def packing_efficiency(lengths: np.ndarray, bins: Sequence[Sequence[int]], capacity: int) -> float:
    """Share of the bins' positions that hold tokens: ``sum(lengths) / (len(bins) * capacity)``."""
    return float(np.sum(lengths)) / max(len(bins) * capacity, 1)


class SFTDataset:
    """Packed (or padded) conversations with their loss masks.

    Args:
        path_prefix: the tokens dataset ``{prefix}_text_document`` (or a preference side
            ``{prefix}_chosen_document``); the mask dataset is ``mask_prefix``.
        mask_prefix: the uint8 loss-mask dataset; default: ``path_prefix`` with ``_document``
            replaced by ``_loss_mask_document``.
        seq_length: positions per sample.
        seed: shuffle seed.
        num_samples: samples to provide (more epochs are packed as needed); None: one epoch.
        documents: int array of the document indices to use (a split); default all.
        packed: pack several conversations per sample (else one per sample, padded).
        packing_window: documents per first-fit-decreasing window (1: first-fit).
        truncate: cut conversations longer than ``seq_length + 1`` tokens (else skip them).
        pad_id: token id of padding positions (their loss mask is 0).
        shuffle: shuffle documents each epoch (False keeps their order, for tests and evaluation).
        cache_dir: folder of the index cache (``--data-cache-path``): the packing is stored there
            as ``.npy`` arrays keyed by a hash of every parameter above, as GPTDataset's indices
            (:mod:`megatron.data.index_cache`), and loaded instead of recomputed; None: in memory.
        split: split name in the cache's file names.

    Attributes:
        report: ``{"documents", "truncated", "skipped_long", "skipped_no_loss_after_truncation",
            "skipped_short", "samples_per_epoch"}``.

    Raises:
        IndexedDatasetError: a dataset is missing or damaged, or the two datasets' documents or
            lengths differ; the message names both prefixes.
        ValueError: ``seq_length < 1``, ``packing_window < 1``, or no usable conversation.
    """

    def __init__(self, path_prefix: str, seq_length: int, seed: int = 1234, num_samples: Optional[int] = None,
                 documents: Optional[np.ndarray] = None, packed: bool = True, packing_window: int = 1000,
                 truncate: bool = True, pad_id: int = 0, mask_prefix: Optional[str] = None,
                 shuffle: bool = True, cache_dir: Optional[str] = None, split: str = "train"):
        if seq_length < 1 or packing_window < 1:
            raise ValueError(f"seq_length ({seq_length}) and packing_window ({packing_window}) must be >= 1")
        mask_prefix = mask_prefix or _mask_prefix(path_prefix)
        self.tokens, self.masks = MMapIndexedDataset(path_prefix), MMapIndexedDataset(mask_prefix)
        if (len(self.tokens.document_indices) != len(self.masks.document_indices)
                or not np.array_equal(self.tokens.document_indices, self.masks.document_indices)
                or not np.array_equal(self.tokens.sizes, self.masks.sizes)):
            raise IndexedDatasetError(f"{path_prefix} and {mask_prefix}: the token and loss-mask datasets "
                                      "do not have the same documents and lengths; write both with "
                                      "tools/preprocess_sft_data.py in one run")
        self.seq_length, self.seed, self.packed = seq_length, seed, packed
        self.window, self.pad_id, self.shuffle = packing_window, pad_id, shuffle
        doc_idx = self.tokens.document_indices
        documents = np.arange(len(doc_idx) - 1) if documents is None else np.asarray(documents, dtype=np.int64)
        # One sequence per document (as the preprocessor writes); length 0 for an empty document.
        lengths = np.where(doc_idx[documents + 1] > doc_idx[documents],
                           self.tokens.sizes[np.minimum(doc_idx[documents], len(self.tokens.sizes) - 1)], 0)
        long, short = lengths > seq_length + 1, lengths < 2
        keep = ~short & (~long if not truncate else True)
        # A truncated conversation whose kept part has no assistant label is skipped, not trained on.
        no_loss = np.zeros_like(keep)
        for k in np.flatnonzero(long & keep):
            no_loss[k] = not self.masks.get(int(doc_idx[documents[k]]), 1, seq_length).any()
        keep &= ~no_loss
        self.report: Dict[str, int] = {"documents": int(keep.sum()), "truncated": int((long & keep).sum()),
                                       "skipped_long": int((long & ~keep & ~no_loss).sum()),
                                       "skipped_no_loss_after_truncation": int(no_loss.sum()),
                                       "skipped_short": int(short.sum())}
        self.documents = documents[keep]
        self.positions = np.minimum(lengths[keep], seq_length + 1) - 1  # positions each one fills
        if len(self.documents) == 0:
            raise ValueError(f"{path_prefix}: no conversation of 2 to {seq_length + 1} tokens to train on "
                             f"({self.report})")
        self.num_samples = None if num_samples is None else int(num_samples)
        description = describe({
            "class": "SFTDataset", "format": _INDEX_FORMAT, "path_prefix": path_prefix,
            "mask_prefix": mask_prefix, "seq_length": seq_length, "seed": seed, "num_samples": num_samples,
            "documents_md5": hashlib.md5(np.ascontiguousarray(documents, dtype=np.int64).tobytes()).hexdigest(),
            "packed": packed, "packing_window": packing_window, "truncate": truncate, "shuffle": shuffle})
        self.description = description  # BlendedDataset keys its own cache on its parts' descriptions
        cache = IndexCache(cache_dir, f"SFTDataset-{split}", description, _CACHED) if cache_dir else None
        arrays = cache.load() if cache else None
        if arrays is None or len(arrays["sample_offsets"]) < 2:
            arrays = self._build_index()
            if cache:
                cache.save(arrays)
        self.sample_offsets, self.sample_documents = arrays["sample_offsets"], arrays["sample_documents"]
        self.report["samples_per_epoch"] = int(arrays["samples_per_epoch"][0])
        self.num_samples = len(self.sample_offsets) - 1

    def _epoch(self, epoch: int) -> List[np.ndarray]:
        """The samples of one epoch: arrays of positions into ``self.documents``."""
        order = np.arange(len(self.documents))
        if self.shuffle:
            np.random.RandomState((self.seed + epoch) % 2**32).shuffle(order)
        if self.packed:
            bins = pack_first_fit(self.positions[order], self.seq_length, self.window)
            return [order[np.asarray(b)] for b in bins]
        return [order[i:i + 1] for i in range(len(order))]

    def _build_index(self) -> Dict[str, np.ndarray]:
        """``sample_offsets`` int64 ``[N + 1]`` into ``sample_documents`` (int64, positions into
        ``self.documents``), epochs packed one after another until ``num_samples``."""
        samples, epoch, per_epoch = [], 0, None
        while True:
            bins = self._epoch(epoch)
            per_epoch = per_epoch or len(bins)
            samples += bins
            epoch += 1
            if self.num_samples is None or len(samples) >= self.num_samples:
                break
        samples = samples[:self.num_samples] if self.num_samples is not None else samples
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(b) for b in samples])
        flat = np.concatenate(samples).astype(np.int64) if samples else np.zeros(0, dtype=np.int64)
        return {"sample_offsets": offsets, "sample_documents": flat,
                "samples_per_epoch": np.array([per_epoch], dtype=np.int64)}

    def __len__(self) -> int:
        return self.num_samples

    def describe(self) -> str:
        """One line for the startup report: conversations, their label positions, samples,
        epochs and the share of sample positions that hold a conversation."""
        epoch = self.report["samples_per_epoch"]
        used = int(np.sum(self.positions, dtype=np.int64))
        return (f"conversations: {len(self.documents)} | positions: {used} | samples: "
                f"{self.num_samples} | epochs: {-(-self.num_samples // epoch)} | "
                f"{'packed' if self.packed else 'one per sequence'}, "
                f"{used / (epoch * self.seq_length):.1%} of positions filled")

    def _locate(self, idx: int) -> np.ndarray:
        """Positions into ``self.documents`` of sample ``idx``'s conversations, in order."""
        return self.sample_documents[self.sample_offsets[idx]:self.sample_offsets[idx + 1]]

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} of {self.num_samples}")
        s = self.seq_length
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        position_ids = np.zeros(s, dtype=np.int64)
        document_ids = np.zeros(s, dtype=np.int64)
        cu = [0]
        for k, j in enumerate(self._locate(idx)):
            doc, n = int(self.documents[j]), int(self.positions[j])
            seq = int(self.tokens.document_indices[doc])
            ids = self.tokens.get(seq, 0, n + 1).astype(np.int64)
            mask = self.masks.get(seq, 0, n + 1)
            a = cu[-1]
            tokens[a:a + n], labels[a:a + n] = ids[:-1], ids[1:]
            loss_mask[a:a + n] = mask[1:]
            position_ids[a:a + n] = np.arange(n)
            document_ids[a:a + n] = k
            cu.append(a + n)
        if cu[-1] < s:  # the padding: a segment of its own
            position_ids[cu[-1]:] = np.arange(s - cu[-1])
            document_ids[cu[-1]:] = len(cu) - 1
            cu.append(s)
        cu_seqlens = np.full(s + 1, -1, dtype=np.int32)
        cu_seqlens[:len(cu)] = cu
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
                "document_ids": document_ids, "cu_seqlens": cu_seqlens,
                "max_seqlen": np.array(max(np.diff(cu)), dtype=np.int32)}


def _mask_prefix(path_prefix: str) -> str:
    if not path_prefix.endswith("_document"):
        raise ValueError(f"{path_prefix}: name the loss-mask dataset (mask_prefix); the default needs a "
                         "tokens prefix ending in _document")
    return path_prefix[:-len("_document")] + "_loss_mask_document"
