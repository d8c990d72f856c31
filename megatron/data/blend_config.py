"""The one parser of ``--data-path`` / ``--{train,valid,test}-data-path`` blends and ``--split``.

Argument validation (``megatron/arguments/validation.py``) and the dataset builder
(``megatron/data/dataset_builder.py``) both call these functions, so whatever validation accepts
is built exactly as it was read. No torch and no file access here.

Sources (NVIDIA Megatron-LM, ``megatron/core/datasets``):

- ``utils.get_blend_from_list``: ``[PREFIX ...]`` or ``[W1, P1, W2, P2, ...]``. An odd number of
  entries, or an even number whose weight positions do not all read as numbers, is a list of
  prefixes without weights (``weights=None``).
- ``blended_megatron_dataset_config.parse_and_normalize_split`` and
  ``convert_split_vector_to_split_matrix``: up to three non-negative shares, normalized; split
  ``i`` covers the fraction ``[lo_i, hi_i)`` of each dataset's sequences, ``None`` when empty.

Where Megatron reads more loosely we refuse, naming the flag: its ``--split`` regex
(``[.0-9]+``) reads ``1e2,1`` as ``1, 2, 1`` and ``nan,1,1`` as ``1, 1``; here each share is one
finite number (``1e2`` is 100), and a list that mixes numbers and prefixes, or a weight that is
not a finite positive number (Megatron's ``BlendedDataset`` asserts positive weights), is an
error instead of a prefix named ``0.5`` that is not found later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

SPLITS = ("train", "valid", "test")
# The flag of each split's own blend, in the order of SPLITS.
SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")
SPLIT_NAMES = {"train": "training", "valid": "validation", "test": "test"}


@dataclass(frozen=True)
class Blend:
    """Datasets of one flag and their weights.

    Attributes:
        flag: the flag that gave them, for messages (``"--data-path"``, ``"--valid-data-path"``).
        prefixes: dataset path prefixes (without ``.bin``/``.idx``), stripped of spaces.
        weights: weights normalized to sum 1 (float64 arithmetic, Megatron's ``normalize``), or
            None when the list gave none.
    """

    flag: str
    prefixes: Tuple[str, ...]
    weights: Optional[Tuple[float, ...]]

    def shown(self) -> str:
        """The prefixes as one string for messages."""
        return " ".join(self.prefixes)


@dataclass(frozen=True)
class SplitSource:
    """Where one split's samples come from.

    Attributes:
        split: ``"train"``, ``"valid"`` or ``"test"``.
        blend: the datasets.
        bookends: ``(lo, hi)``, the fraction of each dataset's sequences this split takes.
        flags: how to name this split's data in messages, e.g. ``"--data-path (a b) with
            --split 98,2,0"`` or ``"--valid-data-path (c)"``.
    """

    split: str
    blend: Blend
    bookends: Tuple[float, float]
    flags: str


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def get_blend_from_list(entries: Optional[Sequence[str]], flag: str = "--data-path") -> Blend:
    """``[PREFIX ...]`` or ``[W1, P1, W2, P2, ...]`` -> a :class:`Blend`.

    Megatron-Core's ``get_blend_from_list`` rules (see the module docstring); unweighted lists of
    several prefixes are kept unweighted (``weights=None``), which the builder treats as Megatron
    does (each dataset one epoch, blended in proportion to its size).

    Raises:
        ValueError: ``--flag (entries): why; how to fix`` for an empty list, a list mixing
            numbers and prefixes, or a weight that is not a finite positive number.
    """
    items = [str(e) for e in (entries or [])]
    shown = " ".join(items)
    if not items:
        raise ValueError(f"{flag} (): no dataset given; pass PREFIX, or pairs WEIGHT PREFIX ...")
    numbers = [_number(e) for e in items]
    weighted = len(items) % 2 == 0 and all(n is not None for n in numbers[0::2])
    if not weighted:
        mixed = [e for e, n in zip(items, numbers) if n is not None]
        if mixed:
            raise ValueError(
                f"{flag} ({shown}): {mixed[0]!r} reads as a weight, but the list is not pairs "
                "WEIGHT PREFIX; write PREFIX [PREFIX ...] or WEIGHT PREFIX WEIGHT PREFIX ...")
        return Blend(flag, tuple(e.strip() for e in items), None)
    prefixes = items[1::2]
    for prefix, n in zip(prefixes, numbers[1::2]):
        if n is not None:
            raise ValueError(f"{flag} ({shown}): {prefix!r} stands where a dataset prefix belongs; "
                             "write pairs WEIGHT PREFIX")
    weights = numbers[0::2]
    for w_text, w, prefix in zip(items[0::2], weights, prefixes):
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"{flag} ({shown}): weight {w_text} of {prefix} must be a finite "
                             "positive number; drop the dataset instead of giving it weight 0")
    total = sum(weights)
    if not math.isfinite(total):
        raise ValueError(f"{flag} ({shown}): the weights overflow when summed; scale them down")
    return Blend(flag, tuple(p.strip() for p in prefixes), tuple(_normalize(weights)))


def _normalize(values: Sequence[float]) -> List[float]:
    # Megatron's utils.normalize: numpy float64 sum, then division (same rounding).
    import numpy as np

    w = np.array(values, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def parse_split(split: str, flag: str = "--split") -> List[float]:
    """``"969, 30, 1"`` -> normalized ``[0.969, 0.03, 0.001]``; missing shares are 0.

    Shares are separated by ``,`` (or ``/``, the older Megatron form); each is one finite
    non-negative number as ``float`` reads it, and at least one is positive.

    Raises:
        ValueError: ``--split (value): why; how to fix``.
    """
    text = str(split)
    sep = "," if "," in text or "/" not in text else "/"
    parts = [p.strip() for p in text.split(sep)]
    values = [_number(p) for p in parts]
    if len(parts) > 3 or any(v is None for v in values):
        raise ValueError(f"{flag} ({text}): expected up to three numbers separated by commas, "
                         "the train, validation and test shares; e.g. --split 969,30,1")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"{flag} ({text}): every share must be a finite number >= 0; "
                         "e.g. --split 969,30,1")
    if sum(values) <= 0:
        raise ValueError(f"{flag} ({text}): the shares sum to 0; give the training split a "
                         "positive share, e.g. --split 969,30,1")
    return _normalize(values + [0.0] * (3 - len(values)))


def split_matrix(split: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Normalized shares -> ``(lo, hi)`` per split, None for an empty share (Megatron-Core's
    ``convert_split_vector_to_split_matrix``)."""
    edges = [0.0]
    for v in split:
        edges.append(edges[-1] + v)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(edges[:-1], edges[1:])]


def split_sources(*, data_path: Optional[Sequence[str]], split: str,
                  train_data_path: Optional[Sequence[str]] = None,
                  valid_data_path: Optional[Sequence[str]] = None,
                  test_data_path: Optional[Sequence[str]] = None) -> List[Optional[SplitSource]]:
    """The source of each split (train, valid, test): ``--data-path`` cut by ``--split``, or
    the per-split flags over all of each dataset (``--split`` then has no effect). A split with
    no share or no flag is None.

    Raises:
        ValueError: both or neither of ``--data-path`` and the per-split flags, no training data
            among the per-split flags, or a malformed blend or split (see above).
    """
    per_split = (train_data_path, valid_data_path, test_data_path)
    given = [f for f, p in zip(SPLIT_FLAGS, per_split) if p is not None]
    if data_path is not None and given:
        raise ValueError(f"--data-path and {', '.join(given)} are mutually exclusive: use "
                         "--data-path with --split, or separate train/valid/test paths")
    if data_path is None:
        if train_data_path is None:
            raise ValueError("no training data: give --data-path PREFIX (with --split) or "
                             "--train-data-path PREFIX")
        sources = []
        for name, flag, entries in zip(SPLITS, SPLIT_FLAGS, per_split):
            if entries is None:
                sources.append(None)
                continue
            blend = get_blend_from_list(entries, flag)
            if len(blend.prefixes) == 1:  # Megatron-Core: one prefix per split is a plain dataset
                blend = Blend(flag, blend.prefixes, None)
            sources.append(SplitSource(name, blend, (0.0, 1.0), f"{flag} ({' '.join(entries)})"))
        return sources
    blend = get_blend_from_list(data_path, "--data-path")
    matrix = split_matrix(parse_split(split))
    where = f"--data-path ({' '.join(map(str, data_path))}) with --split {split}"
    return [SplitSource(name, blend, bookends, where) if bookends else None
            for name, bookends in zip(SPLITS, matrix)]
