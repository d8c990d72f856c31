"""Train/valid/test datasets from ``--data-path`` / ``--split`` or per-split data paths.

Follows Megatron-Core's ``BlendedMegatronDatasetBuilder``:

- ``--data-path PREFIX``: one ``GPTDataset`` per split over the documents of that split;
- ``--data-path W1 P1 W2 P2 ...``: per split, each prefix's ``GPTDataset`` built with
  ``ceil(ceil(n * w) * 1.005)`` samples and a ``BlendedDataset`` of ``sum(ceil(n * w))`` samples;
- ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``: the same per split, each
  over all documents of its prefixes (``--split`` is ignored).

Documents are split by ``--split`` as Megatron-Core does: the normalized weights become bookends
``[0, a, a + b, 1]`` and split ``i`` gets sequences ``[round(lo * n), round(hi * n))``.

Index caches are built by global rank 0 first while the others wait at a barrier (only when
``torch.distributed`` is initialized; torch is imported lazily, so this module loads without it);
the others then load the cache, or build it themselves if their file system does not share it.
"""

from __future__ import annotations

import math
import os
import re
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from megatron.data.blended_dataset import BlendedDataset, get_size_per_dataset, normalize
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import MMapIndexedDataset

SPLITS = ("train", "valid", "test")


def parse_data_path(data_path: Sequence[str], *, flag: str = "--data-path",
                    check_files: bool = True) -> Tuple[List[str], Optional[List[float]]]:
    """``[PREFIX]`` or ``[W1, P1, W2, P2, ...]`` -> ``(prefixes, normalized weights or None)``.

    Needs no process group, so arguments can be validated before any is created.

    Raises:
        ValueError: empty list, an odd number of entries above one, a weight that is not a finite
            positive number, or (with ``check_files``) a prefix whose ``.bin``/``.idx`` is missing;
            the message names ``flag`` and the offending entry.
    """
    entries = [str(e) for e in (data_path or [])]
    if not entries:
        raise ValueError(f"{flag} is empty; give PREFIX or pairs WEIGHT PREFIX ...")
    if len(entries) == 1:
        prefixes, weights = [entries[0].strip()], None
    else:
        if len(entries) % 2:
            raise ValueError(f"{flag} has {len(entries)} entries ({' '.join(entries)}); a blend needs "
                             "pairs WEIGHT PREFIX, e.g. 0.3 data/a_text_document 0.7 data/b_text_document")
        prefixes, raw = [p.strip() for p in entries[1::2]], []
        for i, w in enumerate(entries[0::2]):
            try:
                value = float(w)
            except ValueError:
                raise ValueError(f"{flag} entry {2 * i + 1} ({w!r}) must be a weight before the prefix "
                                 f"{entries[2 * i + 1]!r}") from None
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag}: weight {w} of {entries[2 * i + 1]} must be a positive number")
            raw.append(value)
        weights = normalize(raw)
    if check_files:
        for p in prefixes:
            if not MMapIndexedDataset.exists(p):
                raise ValueError(f"{flag}: dataset {p!r} not found (expected {p}.bin and {p}.idx, "
                                 "as written by tools/preprocess_data.py)")
    return prefixes, weights


def parse_split(split: str) -> List[float]:
    """``"98,2,0"`` -> normalized ``[0.98, 0.02, 0.0]`` (Megatron's ``parse_and_normalize_split``).

    Raises:
        ValueError: more than three numbers, or all zero.
    """
    values = [float(v) for v in re.findall(r"[.0-9]+", str(split))]
    if not values or len(values) > 3 or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative weights such as 98,2,0")
    return normalize(values + [0.0] * (3 - len(values)))


def split_bookends(split: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Normalized split -> ``[(lo, hi) or None]`` per split (Megatron's split matrix)."""
    edges = [0.0]
    for v in split:
        edges.append(edges[-1] + v)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(edges[:-1], edges[1:])]


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
    evals = (iters // eval_interval + 1) * eval_iters if eval_interval > 0 else 0
    return [train_samples, evals * global_batch_size, eval_iters * global_batch_size]


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
        self._indexed = {}

    def indexed(self, prefix: str) -> MMapIndexedDataset:
        if prefix not in self._indexed:
            self._indexed[prefix] = MMapIndexedDataset(prefix)
        return self._indexed[prefix]

    def gpt(self, prefix: str, bookends, num_samples: int, split: str, *, required: bool):
        indexed = self.indexed(prefix)
        n = len(indexed.sizes)
        beg, end = int(round(bookends[0] * float(n))), int(round(bookends[1] * float(n)))
        documents = np.arange(beg, end, dtype=np.int32)
        if len(documents) == 0 or int(np.sum(indexed.sizes[beg:end], dtype=np.int64)) == 0:
            if required:
                raise ValueError(f"{prefix}: the {split} split holds no tokens (documents [{beg}, {end}) "
                                 f"of {n}); change --split or the blend")
            return None
        cache_dir = self.data_cache_path or os.path.join(prefix, "cache", "GPTDataset_indices")
        return GPTDataset(indexed, prefix, documents, num_samples, self.seq_length, self.seed,
                          index_split=split, cache_dir=cache_dir)

    def split(self, prefixes, weights, bookends, num_samples: int, split: str):
        if bookends is None or num_samples <= 0:
            return None
        if weights is None:
            return self.gpt(prefixes[0], bookends, num_samples, split, required=False)
        targets, buffers = get_size_per_dataset(weights, num_samples)
        datasets = [self.gpt(p, bookends, b, split, required=True) for p, b in zip(prefixes, buffers)]
        return BlendedDataset(datasets, weights, sum(targets), cache_dir=self.data_cache_path,
                              index_split=split)


def build_train_valid_test_datasets(*, data_path: Optional[Sequence[str]], split: str,
                                    train_valid_test_num_samples: Sequence[int], seq_length: int,
                                    seed: int, data_cache_path: Optional[str] = None,
                                    train_data_path: Optional[Sequence[str]] = None,
                                    valid_data_path: Optional[Sequence[str]] = None,
                                    test_data_path: Optional[Sequence[str]] = None):
    """``(train, valid, test)`` datasets; None for a split with 0 samples or no documents.

    Must be called on every rank when ``torch.distributed`` is initialized (it holds a barrier).

    Args:
        data_path: ``--data-path`` as given: ``[PREFIX]`` or ``[W1, P1, W2, P2, ...]``; or None
            with the per-split paths.
        split: ``--split``, e.g. ``"98,2,0"`` (ignored with per-split paths).
        train_valid_test_num_samples: samples per split (see :func:`get_train_valid_test_num_samples`).
        seq_length: ``--seq-length``; samples hold ``seq_length + 1`` tokens.
        seed: ``--seed`` for the shuffles.
        data_cache_path: ``--data-cache-path``: folder of all index caches; default a ``cache``
            folder beside each dataset (``{prefix}/cache/GPTDataset_indices``, as Megatron-Core).
        train_data_path, valid_data_path, test_data_path: per-split blends, same form as
            ``data_path``.

    Raises:
        ValueError: both or neither of ``data_path`` and the per-split paths, a malformed blend or
            ``--split``, or a blended dataset without documents in a split it must serve.
    """
    per_split = (train_data_path, valid_data_path, test_data_path)
    if data_path and any(per_split):
        raise ValueError("--data-path cannot be combined with --train/valid/test-data-path")
    if not data_path and not any(per_split):
        raise ValueError("no data: give --data-path or --train-data-path/--valid-data-path/--test-data-path")
    sizes = [int(n) for n in train_valid_test_num_samples]
    if len(sizes) != 3 or min(sizes) < 0:
        raise ValueError(f"train_valid_test_num_samples must be three counts >= 0, got {sizes}")
    if data_path:
        blend = parse_data_path(data_path)
        plan = [(blend, bookends) for bookends in split_bookends(parse_split(split))]
    else:
        flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
        blends = [parse_data_path(p, flag=f) if p else None for p, f in zip(per_split, flags)]
        # Megatron-Core takes a one-prefix per-split blend as a plain dataset, weight or not.
        plan = [((b[0], None if len(b[0]) == 1 else b[1]) if b else None, (0.0, 1.0)) for b in blends]
    builder = _Builder(seq_length, seed, data_cache_path)

    def build():
        return tuple(builder.split(*blend, bookends, n, name) if blend else None
                     for (blend, bookends), n, name in zip(plan, sizes, SPLITS))

    return _rank_zero_first(build)
