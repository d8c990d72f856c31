"""``--mock-data``: synthetic token samples, so a launch script runs without a dataset or a
tokenizer file (Megatron-LM's flag and its ``MockGPTDataset``; pair it with ``--tokenizer-type
NullTokenizer --vocab-size N`` as Megatron-LM's scripts do, or with any real tokenizer).

Each sample is a pure function of ``(seed, split, index)``: the generator
``numpy.random.default_rng([seed, split, index])`` draws it, so the tokens are the same at every
tensor / pipeline / context / data-parallel layout and a resumed run reads exactly the samples
an uninterrupted one would (the samplers start at the consumed-sample count, as for real data).
A sample is ``seq_length + 1`` tokens of documents that count upwards (``a, a+1, a+2, ...``
modulo the non-EOD ids, from a random start, of random length in ``[1, seq_length // 2]``), each
followed by the tokenizer's end-of-document id: a pattern a model learns within a few
iterations, so a smoke test also sees the loss fall, and the EOD tokens exercise
``--eod-mask-loss`` / ``--reset-position-ids`` / ``--reset-attention-mask``. (Megatron-Core's mock
documents are ``1, 2, ..., L-1, EOD``; these start anywhere, so every id occurs.)
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np

SPLIT_INDEX = {"train": 0, "valid": 1, "test": 2}


class MockGPTDataset:
    """``num_samples`` synthetic samples of one split.

    Args:
        num_samples: samples of the split (Megatron's ``train_valid_test_num_samples`` entry).
        seq_length: tokens per sample, without the label shift (a sample holds one more).
        vocab_size: the tokenizer's vocabulary; every id is in ``[0, vocab_size)``.
        eod: the tokenizer's end-of-document id (in ``[0, vocab_size)``).
        seed: ``--seed``.
        split: ``"train"``, ``"valid"`` or ``"test"`` (each split draws other samples).

    Raises:
        ValueError: a non-positive size, fewer than two ids, or ``eod`` outside the vocabulary.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, eod: int, seed: int,
                 split: str = "train"):
        if num_samples < 0 or seq_length < 1:
            raise ValueError(f"--mock-data needs num_samples >= 0 and --seq-length >= 1 "
                             f"(got {num_samples}, {seq_length})")
        if vocab_size < 2 or not 0 <= eod < vocab_size:
            raise ValueError(f"--mock-data needs a vocabulary of at least 2 ids holding the "
                             f"end-of-document id (got vocabulary {vocab_size}, EOD {eod})")
        self.num_samples, self.seq_length = int(num_samples), int(seq_length)
        self.vocab_size, self.eod, self.seed = int(vocab_size), int(eod), int(seed)
        self.split = split
        self._split_index = SPLIT_INDEX[split]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        """``{"text": int64 [seq_length + 1]}``, as :class:`~megatron.data.gpt_dataset.GPTDataset`.

        Raises:
            IndexError: ``idx`` outside ``[0, len(self))``.
        """
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"mock sample {idx} of {self.num_samples}")
        return {"text": self.sample_tokens(int(idx))}

    def describe(self) -> str:
        """The start-up report's line for this split (there are no documents to count)."""
        return (f"synthetic (--mock-data) | samples: {self.num_samples} | tokens per sample: "
                f"{self.seq_length + 1} | vocabulary: {self.vocab_size} | seed: {self.seed}")

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The tokens of sample ``idx``: int64 ``[seq_length + 1]``."""
        rng = np.random.default_rng([self.seed, self._split_index, idx])
        total = self.seq_length + 1
        ids = self.vocab_size - 1  # the non-EOD ids
        longest = max(1, self.seq_length // 2)
        pieces, filled = [], 0
        while filled < total:
            length = int(rng.integers(1, longest + 1))
            start = int(rng.integers(0, ids))
            counted = (start + np.arange(length, dtype=np.int64)) % ids
            pieces += [counted + (counted >= self.eod), np.array([self.eod], dtype=np.int64)]
            filled += length + 1
        return np.concatenate(pieces)[:total]


def build_mock_datasets(num_samples: Sequence[int], *, seq_length: int, vocab_size: int,
                        eod: int, seed: int) -> tuple:
    """``(train, valid, test)`` mock datasets for Megatron's per-split sample counts; None for a
    split that needs no samples (as the real builder leaves out an empty split)."""
    out: list[Optional[MockGPTDataset]] = []
    for split, n in zip(SPLIT_INDEX, num_samples):
        out.append(MockGPTDataset(int(n), seq_length, vocab_size, eod, seed, split)
                   if n and int(n) > 0 else None)
    return tuple(out)
