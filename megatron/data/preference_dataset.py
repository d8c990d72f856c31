"""Preference pairs (prompt + chosen, prompt + rejected) as training sequences, two rows per pair.

Reads the four datasets ``tools/preprocess_sft_data.py --preference-pairs`` writes:
``{prefix}_chosen_document`` and ``{prefix}_rejected_document`` (tokens; document ``k`` of each is
pair ``k``) with their uint8 ``_loss_mask_document`` beside them (1 on the response tokens).

Sample ``2 i`` is the chosen side of the ``i``-th pair in the shuffled order, sample ``2 i + 1`` its
rejected side, so a micro-batch of an even number of rows read in order (Megatron's sequential
sampler, ``--dataloader-type single``) holds whole pairs, chosen and rejected interleaved. Each
row is one conversation, padded (:class:`~megatron.data.sft_dataset.SFTDataset`'s unpacked
sample: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``), plus ``length`` (int64 ``[]``,
the positions before the padding) and ``pair_index`` (int64 ``[]``, the pair's document index, the
key of DPO's cached reference log-probabilities).

A pair is kept when both sides are (2 to ``seq_length + 1`` tokens, or truncated with a response
token left); the others are counted in :attr:`PreferenceDataset.report`. Pairs are shuffled by
``numpy.random.RandomState(seed + epoch)`` per epoch, epochs follow one another until
``num_samples`` rows; sample ``i`` depends on ``(seed, documents, lengths)`` alone. No torch import.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from megatron.data.sft_dataset import SFTDataset

CHOSEN, REJECTED = "_chosen_document", "_rejected_document"


def rejected_prefix(chosen_prefix: str) -> str:
    """``{p}_chosen_document`` -> ``{p}_rejected_document``.

    Raises:
        ValueError: the prefix does not end in ``_chosen_document``."""
    if not chosen_prefix.endswith(CHOSEN):
        raise ValueError(f"{chosen_prefix}: name the chosen side ({{prefix}}{CHOSEN}) that "
                         "tools/preprocess_sft_data.py --preference-pairs wrote")
    return chosen_prefix[:-len(CHOSEN)] + REJECTED


class PreferenceDataset:
    """Chosen and rejected rows of preference pairs, interleaved.

    Args:
        chosen_prefix: ``{prefix}_chosen_document`` (the rejected side and both masks beside it).
        seq_length: positions per row.
        seed: shuffle seed.
        num_samples: rows to provide (a multiple of 2 is used; more epochs as needed); None: one
            epoch.
        documents: int array of the pair indices to use (a split); default all.
        pad_id: token id of padding positions (loss mask 0).
        truncate: cut sides longer than ``seq_length + 1`` tokens (else skip the pair).

    Attributes:
        pairs: int64 ``[P]`` the kept pairs' document indices, ascending.
        report: ``{"pairs", "skipped_pairs", "pairs_per_epoch"}``.

    Raises:
        IndexedDatasetError: a dataset missing or damaged, or a side's tokens and mask differ.
        ValueError: no pair usable.
    """

    def __init__(self, chosen_prefix: str, seq_length: int, seed: int = 1234,
                 num_samples: Optional[int] = None, documents: Optional[np.ndarray] = None,
                 pad_id: int = 0, truncate: bool = True):
        self.sides = [SFTDataset(prefix, seq_length, seed=seed, documents=documents, packed=False,
                                 shuffle=False, pad_id=pad_id, truncate=truncate)
                      for prefix in (chosen_prefix, rejected_prefix(chosen_prefix))]
        chosen, rejected = (side.documents for side in self.sides)
        self.pairs = np.intersect1d(chosen, rejected).astype(np.int64)
        # Unpacked and unshuffled, sample j of a side is its j-th kept document.
        self.rows = [np.searchsorted(side.documents, self.pairs,
                                     sorter=np.argsort(side.documents, kind="stable"))
                     for side in self.sides]
        self.rows = [np.argsort(side.documents, kind="stable")[rows]
                     for side, rows in zip(self.sides, self.rows)]
        given = (len(documents) if documents is not None
                 else len(self.sides[0].tokens.document_indices) - 1)
        if len(self.pairs) == 0:
            raise ValueError(f"{chosen_prefix}: no preference pair with both sides of 2 to "
                             f"{seq_length + 1} tokens")
        self.seed, self.seq_length = seed, seq_length
        wanted = None if num_samples is None else -(-int(num_samples) // 2)
        orders, epoch = [], 0
        while True:
            order = np.arange(len(self.pairs))
            np.random.RandomState((seed + epoch) % 2**32).shuffle(order)
            orders.append(order)
            epoch += 1
            if wanted is None or sum(map(len, orders)) >= wanted:
                break
        self.order = np.concatenate(orders)[:wanted]
        self.report: Dict[str, int] = {"pairs": len(self.pairs),
                                       "skipped_pairs": int(given) - len(self.pairs),
                                       "pairs_per_epoch": len(self.pairs)}
        self.num_samples = 2 * len(self.order)

    def __len__(self) -> int:
        return self.num_samples

    def describe(self) -> str:
        """One line for the startup report."""
        return (f"preference pairs: {len(self.pairs)} (skipped {self.report['skipped_pairs']}) | "
                f"rows: {self.num_samples} (chosen, rejected interleaved) | epochs: "
                f"{-(-len(self.order) // len(self.pairs))}")

    def row(self, pair: int, side: int) -> Dict[str, np.ndarray]:
        """Side ``side`` (0 chosen, 1 rejected) of the ``pair``-th kept pair (``self.pairs``)."""
        sample = self.sides[side][int(self.rows[side][pair])]
        return {"tokens": sample["tokens"], "labels": sample["labels"],
                "loss_mask": sample["loss_mask"], "position_ids": sample["position_ids"],
                "length": np.array(sample["cu_seqlens"][1], dtype=np.int64),
                "pair_index": np.array(self.pairs[pair], dtype=np.int64)}

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} of {self.num_samples}")
        return self.row(int(self.order[idx // 2]), idx % 2)
