"""``NullTokenizer``: texts are whitespace-separated integer ids (Megatron's ``_NullTokenizer``)."""

from __future__ import annotations

from typing import List, Sequence

from .base import AbstractTokenizer


class NullTokenizer(AbstractTokenizer):
    """Ids written out as text, for synthetic data and tests.

    Args:
        vocab_size: ids ``0 .. vocab_size-1`` are valid in the text; the end-of-document id is
            ``vocab_size`` itself, so ``self.vocab_size == vocab_size + 1`` (Megatron's rule).

    Raises:
        ValueError: ``vocab_size`` is missing or not positive; ``tokenize`` gets a word that is not
            an integer in range.
    """

    name = "NullTokenizer"

    def __init__(self, vocab_size):
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(f"NullTokenizer needs --vocab-size N with N > 0 (got {vocab_size})")
        self._n = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(w) for w in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer: text must be whitespace-separated integers ({e})") from None
        if ids and (min(ids) < 0 or max(ids) >= self._n):
            raise ValueError(f"NullTokenizer: ids must lie in [0, {self._n}) for --vocab-size {self._n}; "
                             f"got {min(ids)}..{max(ids)}")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)
