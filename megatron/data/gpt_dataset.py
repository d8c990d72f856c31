"""Megatron's GPT dataset: fixed-length samples cut across document boundaries.

The document, sample and shuffle indices equal, array for array, the ones Megatron-Core builds
(``megatron/core/datasets/gpt_dataset.py`` and ``build_sample_idx`` of ``helpers.cpp``, with
``add_extra_token_to_sequence=True`` and ``drop_last_partial_sequence=True``) for the same
documents, sequence length, seed and number of samples, so a run moved over from Megatron-LM sees
the same samples in the same order. The sample index is computed in vectorized numpy instead of
Megatron's C++ loop (no compile step).

How the indices are built (``S`` = sequence length, ``N`` = requested samples):

1. ``num_epochs``: the fewest passes over the documents giving ``N * S + 1`` tokens.
2. ``document_index`` int32: the documents repeated ``num_epochs`` times, shuffled by
   ``numpy.random.RandomState(seed)``. When the final epoch contributes fewer than 80% of an
   epoch's samples, it is shuffled separately (so the first epochs are not diluted by it).
3. ``sample_index`` ``[num_samples + 1, 2]``: ``(position in document_index, token offset)`` where
   sample ``i`` starts. The documents of ``document_index`` are concatenated; sample ``i`` covers
   tokens ``[i * S, i * S + S + 1)`` of that stream, so consecutive samples share one token (the
   last label of one sample is the first input of the next, as in Megatron).
4. ``shuffle_index``: a permutation of the samples by the same ``RandomState``, again with the
   separately shuffled final epoch.

No torch import.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Dict, Optional, Tuple

import numpy as np

from megatron.data.index_cache import IndexCache, describe

logger = logging.getLogger(__name__)

# Megatron-Core: the final epoch is shuffled apart when it holds fewer than this share of an epoch.
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
# Bump when the construction changes, so caches of an older construction are never reused.
_INDEX_FORMAT = 1


def get_num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int]) -> int:
    """Fewest epochs giving ``num_samples * seq_length + 1`` tokens (Megatron's ``_get_num_epochs``);
    one epoch when ``num_samples`` is None (Megatron's "one epoch" datasets of unweighted blends)."""
    if tokens_per_epoch <= 0:
        raise ValueError("the documents of this split hold no tokens")
    if num_samples is None:
        return 1
    tokens_requested = num_samples * seq_length + 1
    return max(1, -(-tokens_requested // tokens_per_epoch))


def separate_final_epoch_split(tokens_per_epoch: int, seq_length: int, num_samples: int,
                               num_epochs: int) -> Optional[int]:
    """Samples before the final epoch when it is shuffled apart, else None.

    Megatron-Core's rule: with more than one epoch, the final epoch is separate when it
    contributes fewer than ``int(0.8 * samples_per_epoch)`` of the requested samples.
    """
    if num_epochs == 1:
        return None
    num_samples_sans_final_epoch = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    num_samples_from_final_epoch = num_samples - num_samples_sans_final_epoch
    num_samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    assert 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1
    if num_samples_from_final_epoch < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * num_samples_per_epoch):
        return num_samples_sans_final_epoch
    return None


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """``documents`` repeated ``num_epochs`` times and shuffled; int32 ``[num_epochs * D]``.

    Draws from ``rng`` exactly as Megatron's ``_build_document_index`` (one ``shuffle`` of the
    whole array, or one of the first ``num_epochs - 1`` epochs then one of the last).
    """
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    document_index = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
    rng.shuffle(document_index)
    return document_index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       tokens_per_epoch: int, num_epochs: int) -> np.ndarray:
    """Start ``(document_index position, token offset)`` of every sample; ``[num_samples + 1, 2]``.

    Equal to ``build_sample_idx`` of Megatron's ``helpers.cpp`` (dtype int32 unless a value may
    exceed it, then int64, as Megatron's ``helpers.build_sample_idx`` chooses). Sample ``i`` ends
    where sample ``i + 1`` starts, at token ``(i + 1) * seq_length`` of the concatenated stream;
    a sample ending exactly at a document's last token points at that token (not at the next
    document), which is where Megatron's loop leaves it.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths = np.asarray(sizes)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # The document holding token p is the first whose end lies beyond p (empty ones never do).
    doc = np.searchsorted(ends, positions, side="right")
    offset = positions - (ends - lengths)[doc]
    limit = max(len(document_index), int(np.max(sizes)) if len(sizes) else 0)
    dtype = np.int32 if limit <= np.iinfo(np.int32).max else np.int64
    sample_index = np.stack((doc, offset), axis=1).astype(dtype)
    sample_index[0] = 0  # Megatron starts at (0, 0) even when the first document is empty
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffled ``[0, num_samples)`` then, if ``total_size`` is larger, shuffled
    ``[num_samples, total_size)`` (Megatron's ``_build_shuffle_index``); uint32 or int64."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int,
                  num_samples: Optional[int], seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's ``(document_index, sample_index, shuffle_index)`` for a GPT dataset.

    Args:
        sizes: int32 ``[S]``, tokens per sequence of the indexed dataset.
        documents: int ``[D]``, the sequence ids of this split (Megatron's ``indices``).
        seq_length: tokens per sample, without the extra label token.
        num_samples: samples requested; the result holds at least this many (whole epochs). None:
            exactly one epoch, ``(tokens - 1) // seq_length`` samples.
        seed: seed of ``numpy.random.RandomState`` (``--seed``).
    """
    tokens_per_epoch = int(np.sum(np.asarray(sizes)[documents], dtype=np.int64))
    num_epochs = get_num_epochs(tokens_per_epoch, seq_length, num_samples)
    split_at = separate_final_epoch_split(tokens_per_epoch, seq_length, num_samples, num_epochs)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, split_at is not None)
    sample_index = build_sample_index(sizes, document_index, seq_length, tokens_per_epoch, num_epochs)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(total if split_at is None else split_at, total, rng)
    return document_index, sample_index, shuffle_index


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from a split of an indexed dataset.

    Args:
        indexed_dataset: a ``MMapIndexedDataset`` (anything with ``sizes`` and ``get``).
        dataset_path: the dataset's path prefix; recorded in the cache description.
        documents: int ``[D]``, the sequence ids of this split.
        num_samples: samples requested (>= 1); ``len(self)`` may be larger (whole epochs). None:
            one epoch (Megatron-Core's ``num_samples=None``, used for unweighted blends).
        seq_length: tokens per sample without the extra label token (``--seq-length``).
        seed: ``--seed``.
        index_split: ``"train"``, ``"valid"`` or ``"test"``; part of the cache file names.
        cache_dir: folder of the index cache, or None to build in memory without caching.

    ``self[i]`` is ``{"text": int64 [seq_length + 1]}``: sample ``shuffle_index[i]``.

    Raises:
        ValueError: ``num_samples`` or ``seq_length`` below 1, or the split holds no tokens or
            fewer than ``seq_length + 1``.
    """

    def __init__(self, indexed_dataset, dataset_path: str, documents: np.ndarray,
                 num_samples: Optional[int], seq_length: int, seed: int, *,
                 index_split: str = "train", cache_dir: Optional[str] = None):
        if seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"GPTDataset needs at least 1 sample, got {num_samples}")
        self.indexed_dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.documents = np.asarray(documents, dtype=np.int32)
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.seed = seed
        self.index_split = index_split
        self.built_anew = False
        sizes = np.asarray(indexed_dataset.sizes)
        tokens = int(np.sum(sizes[self.documents], dtype=np.int64))
        if 0 < tokens < seq_length + 1:  # a sample would repeat the split's few tokens
            raise ValueError(
                f"the {index_split} split of {dataset_path} holds {tokens} tokens, fewer than one "
                f"sample of --seq-length {seq_length} (+1 for the labels): use more data, a larger "
                "share of it for this split (--split), or a shorter --seq-length")
        self.description = describe({
            "class": "GPTDataset", "index_format": _INDEX_FORMAT, "dataset_path": dataset_path,
            "index_split": index_split, "num_documents": int(len(self.documents)),
            "documents_md5": hashlib.md5(self.documents.tobytes()).hexdigest(),
            "sizes_md5": hashlib.md5(np.ascontiguousarray(sizes[self.documents]).tobytes()).hexdigest(),
            "num_samples": num_samples, "sequence_length": seq_length, "random_seed": seed,
            "add_extra_token_to_sequence": True, "drop_last_partial_sequence": True,
        })
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(sizes, cache_dir)

    def _expected_shapes(self, sizes: np.ndarray) -> Dict[str, tuple]:
        tokens = int(np.sum(sizes[self.documents], dtype=np.int64))
        epochs = get_num_epochs(tokens, self.seq_length, self.num_samples)
        total = (epochs * tokens - 1) // self.seq_length
        return {"document_index": (epochs * len(self.documents),), "sample_index": (total + 1, 2),
                "shuffle_index": (total,)}

    def _load_or_build(self, sizes: np.ndarray, cache_dir: Optional[str]):
        names = ("document_index", "sample_index", "shuffle_index")
        self.cache = cache = IndexCache(cache_dir, f"GPTDataset-{self.index_split}", self.description,
                                        names) if cache_dir else None
        if cache is not None:
            arrays = cache.load()
            expected = self._expected_shapes(sizes)
            if arrays is not None and all(arrays[n].shape == expected[n] for n in names):
                logger.info("loaded GPTDataset %s indices from %s", self.index_split, cache.path("*"))
                return tuple(arrays[n] for n in names)
            if arrays is not None:
                logger.warning("%s: cached arrays have unexpected shapes; rebuilding", cache.path("*"))
        built = build_indices(sizes, self.documents, self.seq_length, self.num_samples, self.seed)
        self.built_anew = True
        if cache is not None:
            cache.save(dict(zip(names, built)))
        return built

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for a GPTDataset of {n} samples")
        return {"text": self.sample_tokens(int(self.shuffle_index[idx]))}

    def sample_tokens(self, sample: int) -> np.ndarray:
        """Tokens of unshuffled sample ``sample``: int64 ``[seq_length + 1]``."""
        doc_beg, offset_beg = (int(v) for v in self.sample_index[sample])
        doc_end, offset_end = (int(v) for v in self.sample_index[sample + 1])
        get = self.indexed_dataset.get
        if doc_beg == doc_end:
            parts = [get(self.document_index[doc_beg], offset=offset_beg,
                         length=offset_end - offset_beg + 1)]
        else:
            parts = [get(self.document_index[doc_beg], offset=offset_beg)]
            parts += [get(self.document_index[i]) for i in range(doc_beg + 1, doc_end)]
            parts.append(get(self.document_index[doc_end], offset=0, length=offset_end + 1))
        return np.concatenate(parts).astype(np.int64)
