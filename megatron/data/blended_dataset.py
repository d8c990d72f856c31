"""Weighted blend of datasets in Megatron's greedy, error-minimising order.

``--data-path 0.3 A 0.7 B``: sample ``i`` of the blend comes from the dataset whose share so far
lags its weight the most: ``argmax_d (w_d * max(i, 1) - count_d)``, ties to the lowest ``d``
(``build_blending_indices`` of Megatron's ``helpers.cpp``). Each dataset's count after every
prefix of ``n`` samples stays within one sample of ``w_d * n``. The arrays equal Megatron's
bit for bit: the errors are computed with the same float64 operations in the same order.

No torch import.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.data.index_cache import IndexCache, describe

logger = logging.getLogger(__name__)

# Megatron-Core's ``mid_level_dataset_surplus``: each dataset builds 0.5% more samples than its
# share, so the greedy order never runs past the end of one.
MID_LEVEL_DATASET_SURPLUS = 0.005
_BLOCK = 4096


def normalize(weights: Sequence[float]) -> List[float]:
    """Weights divided by their sum, in float64 (Megatron's ``utils.normalize``)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def get_size_per_dataset(weights: Sequence[float], size: int,
                         surplus: float = MID_LEVEL_DATASET_SURPLUS) -> Tuple[List[int], List[int]]:
    """Samples each dataset contributes to a blend of ``size``, and how many it should build.

    Megatron-Core's ``_get_size_per_split_per_dataset``: the target of dataset ``d`` is
    ``ceil(size * w_d)`` (the blend's length is the sum of the targets, at least ``size``); each
    dataset builds ``ceil(target * (1 + surplus))``.

    Args:
        weights: normalized weights.
        size: samples requested from the blend.
    """
    targets = [int(math.ceil(size * w)) for w in weights]
    return targets, [int(math.ceil(t * (1 + surplus))) for t in targets]


def _greedy_python(weights: List[float], counts: List[int], start: int, stop: int,
                   dataset_index: np.ndarray, dataset_sample_index: np.ndarray) -> None:
    """The greedy of ``helpers.cpp`` step by step for samples ``[start, stop)``; updates ``counts``."""
    n = len(weights)
    for i in range(start, stop):
        x = max(float(i), 1.0)
        best, best_error = 0, weights[0] * x - counts[0]
        for d in range(1, n):
            error = weights[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1


def _predict(counts: np.ndarray, weights: np.ndarray, b: int) -> np.ndarray:
    """A guess of the next ``b`` picks: each dataset's next picks placed near ``count / w``."""
    per = np.ceil(b * weights).astype(np.int64) + 2
    ds = np.repeat(np.arange(len(weights)), per)
    j = np.arange(len(ds)) - np.repeat(np.cumsum(per) - per, per)
    keys = (counts[ds] + j) / weights[ds]
    return ds[np.lexsort((ds, keys))[:b]]


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron's ``(dataset_index int16 [size], dataset_sample_index int64 [size])``.

    Sample ``i`` of the blend is sample ``dataset_sample_index[i]`` of dataset
    ``dataset_index[i]``. The greedy is sequential; blocks of picks are guessed and then verified
    in numpy (the errors of every step of the block computed at once from the guess's running
    counts: the guess is right up to its first disagreement with the argmax, and the argmax there
    is the true pick). Guesses are nearly always right for two datasets; where they are not, the
    block runs step by step, which is exact too (about 1 us per sample).

    Args:
        weights: normalized weights (zero weights are never picked after sample 0).
        size: samples of the blend.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if n >= np.iinfo(np.int16).max:
        raise ValueError(f"a blend holds at most {np.iinfo(np.int16).max - 1} datasets, got {n}")
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    counts = np.zeros(n, dtype=np.int64)
    eye = np.eye(n, dtype=np.int64)
    i = 0
    while i < size:
        b = min(_BLOCK, size - i)
        guess = _predict(counts, np.maximum(w, 1e-300), b)
        onehot = eye[guess]
        running = counts[None, :] + np.cumsum(onehot, axis=0) - onehot  # counts before each pick
        steps = np.maximum(np.arange(i, i + b, dtype=np.float64), 1.0)
        actual = np.argmax(w[None, :] * steps[:, None] - running.astype(np.float64), axis=1)
        wrong = np.flatnonzero(actual != guess)
        k = b if len(wrong) == 0 else int(wrong[0]) + 1
        if k < b // 2:  # poor guess: do this block step by step
            c = counts.tolist()
            _greedy_python(w.tolist(), c, i, i + b, dataset_index, dataset_sample_index)
            counts = np.array(c, dtype=np.int64)
            i += b
            continue
        picks = actual[:k]
        dataset_index[i:i + k] = picks
        dataset_sample_index[i:i + k] = running[np.arange(k), picks]
        counts = running[k - 1] + eye[picks[-1]]
        i += k
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Samples drawn from several datasets in Megatron's greedy weighted order.

    Args:
        datasets: the datasets (``GPTDataset``), each with ``description`` and ``len``.
        weights: one per dataset, positive; normalized here.
        size: samples of the blend.
        cache_dir: folder for the cached index arrays (``--data-cache-path``), or None.
        index_split: ``"train"``, ``"valid"`` or ``"test"``; part of the cache file names.

    ``self[i]`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]`` (``{"text": ...}``).

    Raises:
        ValueError: no datasets, weights and datasets differ in number, or a dataset is too
            short for the samples the blend takes from it (the message names it).
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, *,
                 cache_dir: Optional[str] = None, index_split: str = "train"):
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset needs one weight per dataset, got {len(weights)} weights "
                             f"for {len(datasets)} datasets")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = int(size)
        self.description = describe({
            "class": "BlendedDataset", "index_split": index_split,
            "datasets": [hashlib.md5(d.description.encode()).hexdigest() for d in self.datasets],
            "weights": self.weights, "size": self.size})
        names = ("dataset_index", "dataset_sample_index")
        self.cache = IndexCache(cache_dir, f"BlendedDataset-{index_split}", self.description, names) \
            if cache_dir else None
        arrays = self.cache.load() if self.cache else None
        self.built_anew = arrays is None or any(a.shape != (self.size,) for a in arrays.values())
        if self.built_anew:
            arrays = dict(zip(names, build_blending_indices(self.weights, self.size)))
            if self.cache:
                self.cache.save(arrays)
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        self._check_bounds()

    def _check_bounds(self) -> None:
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (count, dataset) in enumerate(zip(counts, self.datasets)):
            if count > len(dataset):
                raise ValueError(
                    f"blended dataset {d} ({getattr(dataset, 'dataset_path', '?')}) has {len(dataset)} "
                    f"samples but the blend takes {count} from it; build it with more samples")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a BlendedDataset of {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
