"""Train/valid/test datasets from ``--data-path`` / ``--split`` or per-split data paths.

Follows Megatron-Core's ``BlendedMegatronDatasetBuilder`` (``megatron/core/datasets/
blended_megatron_dataset_builder.py``); flags are read by :mod:`megatron.data.blend_config`, the
same functions argument validation uses. Per split:

- one prefix without weight: one ``GPTDataset`` over that split's sequences;
- ``W1 P1 W2 P2 ...`` (weighted): each prefix's ``GPTDataset`` built with
  ``ceil(ceil(n * w) * 1.005)`` samples and a ``BlendedDataset`` of ``sum(ceil(n * w))`` samples;
- ``P1 P2 ...`` (several prefixes, no weights; Megatron's case "weights is None and size is not
  None"): each prefix's ``GPTDataset`` holds exactly one epoch (``num_samples=None``:
  ``(tokens - 1) // seq_length`` samples), and the ``BlendedDataset`` blends them with weights
  equal to those lengths and has ``min(n, sum of lengths)`` samples. Such a blend never repeats
  data: a run that needs more samples needs weights (or ``--dataloader-type cyclic``), which
  argument validation says before the model is built (:func:`check_train_valid_test_data`).
- ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``: the same per split, each
  over all sequences of its prefixes (``--split`` has no effect); one prefix is a plain dataset
  even with a weight, as in Megatron-Core.

Sequences are split by ``--split`` as Megatron-Core does: the normalized shares become bookends
``[0, a, a + b, 1]`` and split ``i`` gets sequences ``[round(lo * n), round(hi * n))``. The test
split, evaluated once at the end, is left out when its share holds no tokens of any of its
datasets (``--split 969,30,1`` on fewer than 500 documents); in an unweighted blend a dataset
whose share holds less than one sample is left out of that split; any other share below one
sample is an error naming the flags (:func:`plan_split`).

Index caches are built by global rank 0 first while the others wait at a barrier (only when
``torch.distributed`` is initialized; torch is imported lazily, so this module loads without it);
the others then load the cache, or build it themselves if their file system does not share it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from megatron.data.blend_config import SPLIT_NAMES, SPLITS, SplitSource, split_sources
from megatron.data.blended_dataset import BlendedDataset, get_size_per_dataset
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset


def get_train_valid_test_num_samples(*, global_batch_size: int, train_iters: Optional[int] = None,
                                     train_samples: Optional[int] = None, eval_interval: int,
                                     eval_iters: int) -> List[int]:
    """Samples each split must provide, as Megatron's ``get_train_valid_test_num_samples``.

    Sample-based (``--train-samples``) or iteration-based (``--train-iters``) training;
    validation runs ``eval_iters`` iterations every ``eval_interval`` and once at the end.
    """
    if (train_iters is None) == (train_samples is None):
        raise ValueError("give exactly one of --train-iters and --train-samples")
    if train_samples is None:
        train_samples = train_iters * global_batch_size
    iters = train_iters if train_iters is not None else train_samples // global_batch_size
    evals = (iters // eval_interval + 1) * eval_iters if eval_interval and eval_interval > 0 else 0
    return [train_samples, evals * global_batch_size, eval_iters * global_batch_size]


def one_epoch_samples(tokens: int, seq_length: int) -> int:
    """Samples of ``seq_length + 1`` tokens in one epoch of ``tokens`` (consecutive samples share
    one token): the length of a one-epoch ``GPTDataset``."""
    return max(0, (int(tokens) - 1) // int(seq_length))


@dataclass(frozen=True)
class DatasetPart:
    """One dataset's share of one split.

    Attributes:
        prefix: the dataset's path prefix.
        indexed: the opened ``.bin``/``.idx`` pair.
        documents: int32 ``[D]``, the sequence ids of this split: ``range(*span)``.
        span: ``(begin, end)`` of those ids.
        tokens: tokens in those sequences.
    """

    prefix: str
    indexed: MMapIndexedDataset
    documents: np.ndarray
    span: tuple
    tokens: int


def open_dataset(prefix: str, source: SplitSource, cache: Optional[dict] = None) -> MMapIndexedDataset:
    """The pair at ``prefix`` (validated on open, from the ``.idx``; see ``MMapIndexedDataset``).

    Raises:
        ValueError: ``--flag (value): file: problem`` when the pair is missing, damaged or holds
            no tokens; the flag is the one that gave the prefix (validation data named as such).
    """
    if cache is not None and prefix in cache:
        return cache[prefix]
    where = f"{source.flags}, {SPLIT_NAMES[source.split]} data"
    try:
        indexed = MMapIndexedDataset(prefix)
    except IndexedDatasetError as err:
        raise ValueError(f"{where}: {err}") from None
    if len(indexed) == 0 or indexed.num_tokens == 0:
        raise ValueError(f"{where}: dataset {prefix} holds no tokens ({len(indexed)} sequences); "
                         "preprocess a non-empty corpus with tools/preprocess_data.py, or drop it "
                         "from the list")
    if cache is not None:
        cache[prefix] = indexed
    return indexed


def plan_split(source: SplitSource, seq_length: int,
               cache: Optional[dict] = None) -> Optional[List[DatasetPart]]:
    """Each dataset's sequences in the split ``source`` describes.

    A dataset's share must hold one sample (``seq_length + 1`` tokens), with two exceptions: in
    an unweighted blend a share without one contributes nothing and is left out (its length, so
    its weight in Megatron's rule, is 0; Megatron itself fails on it), and a test split where no
    dataset holds a token is None (left out; it is evaluated once, at the end).

    Raises:
        ValueError: a dataset cannot be opened or is empty, or a share (of a training or
            validation split, or of a test split other datasets fill) is too small; the message
            names the flags and the fix.
    """
    parts = []
    for prefix in source.blend.prefixes:
        indexed = open_dataset(prefix, source, cache)
        n = len(indexed)
        beg, end = int(round(source.bookends[0] * float(n))), int(round(source.bookends[1] * float(n)))
        tokens = int(indexed.sizes[beg:end].sum(dtype=np.int64))
        parts.append(DatasetPart(prefix, indexed, np.arange(beg, end, dtype=np.int32), (beg, end), tokens))
    if source.split == "test" and not any(p.tokens for p in parts):
        return None
    if source.blend.weights is None and len(parts) > 1:
        kept = [p for p in parts if p.tokens >= seq_length + 1]
        parts = kept or parts[:1]  # none left: the error below names the first
    for p in parts:
        if p.tokens < seq_length + 1:
            raise ValueError(
                f"{source.flags}: the {source.split} split of {p.prefix} holds {p.tokens} tokens "
                f"(sequences [{p.span[0]}, {p.span[1]}) of {len(p.indexed)}), fewer than one sample of "
                f"--seq-length {seq_length} (+1 for the labels): use more data, a larger share of "
                "it for this split (--split), or a shorter --seq-length")
    return parts


def check_train_valid_test_data(sources: Sequence[Optional[SplitSource]], *, seq_length: int,
                                num_samples: Sequence[int], dataloader_type: str = "single") -> None:
    """What :func:`build_train_valid_test_datasets` would refuse, from the ``.idx`` files only
    (no index is built, nothing is written); argument validation calls it before the model is
    built.

    Also refuses an unweighted blend of several datasets whose one epoch holds fewer samples than
    the split needs when the data loader does not cycle (``--dataloader-type single``): such a
    blend never repeats data (Megatron-Core's rule), so the run would stop when it runs out.

    Args:
        sources: from :func:`megatron.data.blend_config.split_sources`.
        seq_length: ``--seq-length``.
        num_samples: samples each split needs (0: not used), as
            :func:`get_train_valid_test_num_samples`.
        dataloader_type: ``--dataloader-type``.

    Raises:
        ValueError: ``--flag (value): why; how to fix``.
    """
    cache = {}
    for source, n in zip(sources, num_samples):
        if source is None or n <= 0:
            continue
        parts = plan_split(source, seq_length, cache)
        if parts is None or source.blend.weights is not None or len(source.blend.prefixes) == 1:
            continue
        available = sum(one_epoch_samples(p.tokens, seq_length) for p in parts)
        if available < n and dataloader_type != "cyclic":
            raise ValueError(
                f"{source.flags}: without weights each dataset is used for one epoch (as in "
                f"Megatron-LM), {available} samples of --seq-length {seq_length} for the "
                f"{SPLIT_NAMES[source.split]} split, which needs {n}; give weights "
                "(WEIGHT PREFIX ...) to repeat the data, use --dataloader-type cyclic, or train "
                "or evaluate on fewer samples")


def _rank_zero_first(build: Callable):
    """``build()`` on global rank 0, a barrier, then ``build()`` on the other ranks."""
    try:
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except ImportError:
        distributed = False
    if not distributed:
        return build()
    if dist.get_rank() == 0:
        try:
            result, error = build(), None
        except Exception as err:  # release the others; they meet the same error themselves
            result, error = None, err
        dist.barrier()
        if error is not None:
            raise error
        return result
    dist.barrier()
    return build()


class _Builder:
    def __init__(self, seq_length: int, seed: int, data_cache_path: Optional[str]):
        self.seq_length, self.seed, self.data_cache_path = seq_length, seed, data_cache_path
        self._opened = {}

    def gpt(self, part: DatasetPart, num_samples: Optional[int], split: str) -> GPTDataset:
        cache_dir = self.data_cache_path or os.path.join(part.prefix, "cache", "GPTDataset_indices")
        return GPTDataset(part.indexed, part.prefix, part.documents, num_samples, self.seq_length,
                          self.seed, index_split=split, cache_dir=cache_dir)

    def split(self, source: Optional[SplitSource], num_samples: int):
        if source is None or num_samples <= 0:
            return None
        parts = plan_split(source, self.seq_length, self._opened)
        if parts is None:
            return None
        weights, split = source.blend.weights, source.split
        if weights is None and len(source.blend.prefixes) == 1:
            return self.gpt(parts[0], num_samples, split)
        if weights is None:  # one epoch each, blended in proportion to their lengths
            datasets = [self.gpt(p, None, split) for p in parts]
            lengths = [len(d) for d in datasets]
            return BlendedDataset(datasets, lengths, min(num_samples, sum(lengths)),
                                  cache_dir=self.data_cache_path, index_split=split)
        targets, buffers = get_size_per_dataset(weights, num_samples)
        datasets = [self.gpt(p, b, split) for p, b in zip(parts, buffers)]
        return BlendedDataset(datasets, weights, sum(targets), cache_dir=self.data_cache_path,
                              index_split=split)


def build_train_valid_test_datasets(*, data_path: Optional[Sequence[str]], split: str,
                                    train_valid_test_num_samples: Sequence[int], seq_length: int,
                                    seed: int, data_cache_path: Optional[str] = None,
                                    train_data_path: Optional[Sequence[str]] = None,
                                    valid_data_path: Optional[Sequence[str]] = None,
                                    test_data_path: Optional[Sequence[str]] = None):
    """``(train, valid, test)`` datasets; None for a split with 0 samples or no source.

    Must be called on every rank when ``torch.distributed`` is initialized (it holds a barrier).

    Args:
        data_path: ``--data-path`` as given: ``[PREFIX ...]`` or ``[W1, P1, W2, P2, ...]``; or
            None with the per-split paths.
        split: ``--split``, e.g. ``"98,2,0"`` (no effect with per-split paths).
        train_valid_test_num_samples: samples per split (see :func:`get_train_valid_test_num_samples`).
        seq_length: ``--seq-length``; samples hold ``seq_length + 1`` tokens.
        seed: ``--seed`` for the shuffles.
        data_cache_path: ``--data-cache-path``: folder of all index caches; default a ``cache``
            folder beside each dataset (``{prefix}/cache/GPTDataset_indices``, as Megatron-Core).
        train_data_path, valid_data_path, test_data_path: per-split blends, same form as
            ``data_path``.

    Raises:
        ValueError: a malformed flag (see :mod:`megatron.data.blend_config`), a missing, damaged
            or empty dataset, or a split without enough tokens (see :func:`plan_split`).
    """
    sources = split_sources(data_path=data_path, split=split, train_data_path=train_data_path,
                            valid_data_path=valid_data_path, test_data_path=test_data_path)
    sizes = [int(n) for n in train_valid_test_num_samples]
    if len(sizes) != 3 or min(sizes) < 0:
        raise ValueError(f"train_valid_test_num_samples must be three counts >= 0, got {sizes}")
    builder = _Builder(seq_length, seed, data_cache_path)

    def build():
        return tuple(builder.split(source, n) for source, n in zip(sources, sizes))

    return _rank_zero_first(build)


__all__ = ["SPLITS", "DatasetPart", "build_train_valid_test_datasets", "check_train_valid_test_data",
           "get_train_valid_test_num_samples", "one_epoch_samples", "open_dataset", "plan_split"]
