"""The one tokenizer interface every tokenizer type implements (Megatron's ``MegatronTokenizer``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from itertools import chain
from typing import List, Optional, Sequence, Tuple

import numpy as np


class AbstractTokenizer(ABC):
    """Token ids in, text out, plus the special ids the data pipeline and the trainer need.

    Attributes:
        vocab_size: ids the tokenizer can emit (unpadded; see ``vocab_size_with_padding``).
        eod: id appended after each document by ``--append-eod``.
        bos: beginning-of-sequence id, or None.
        pad: padding id, or None.
    """

    name: str = "abstract"

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eod(self) -> int: ...

    @property
    def bos(self) -> Optional[int]:
        return None

    @property
    def pad(self) -> Optional[int]:
        return None

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Token ids of one text."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of a sequence of token ids."""

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> List[List[int]]:
        """Token ids of many texts; ``tokenize`` of each, through the library's batch path if it has one.

        Args:
            texts: the texts.
            num_threads: threads the library may use (ignored where it has no batch path).
        """
        return [self.tokenize(t) for t in texts]

    def tokenize_batch_flat(self, texts: Sequence[str], dtype=np.int64,
                            num_threads: int = 1) -> Tuple[np.ndarray, np.ndarray]:
        """Token ids of many texts back to back, for writers that need one array (the preprocessor).

        Args:
            texts: the texts.
            dtype: numpy dtype of the returned ids; the caller picks one that holds ``vocab_size``.
            num_threads: as in ``tokenize_batch``.

        Returns:
            ``(flat, lengths)``: ``flat`` 1-D ``dtype``, the ids of all texts in order; ``lengths``
            1-D int64 ``[len(texts)]``, ids per text (0 for a text that tokenizes to nothing).
        """
        docs = self.tokenize_batch(texts, num_threads=num_threads)
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        flat = np.fromiter(chain.from_iterable(docs), dtype=dtype, count=int(lengths.sum()))
        return flat, lengths
