"""SentencePiece tokenizers: ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``.

All three follow current Megatron-LM's ids for a LLaMA-style ``.model``: the vocabulary is the
model's pieces (nothing added), end-of-document is the model's ``</s>``, and documents are
encoded without BOS, so ``tools/preprocess_data.py`` writes the same ``.bin/.idx`` as Megatron-LM's
preprocessor (checked against ``megatron-lm-reference`` in the tests).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .base import AbstractTokenizer


class SentencePieceTokenizer(AbstractTokenizer):
    """A SentencePiece ``.model`` file.

    Args:
        model_file: path of the ``.model`` (``--tokenizer-model``).

    Raises:
        FileNotFoundError: the model file is missing.
        ValueError: the model has no end-of-sentence piece to use as end-of-document.
    """

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str):
        import sentencepiece

        if not model_file or not os.path.isfile(model_file):
            raise FileNotFoundError(f"--tokenizer-model {model_file!r}: SentencePiece .model file not found")
        self.model_file = model_file
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as exc:  # sentencepiece's "could not parse ModelProto"
            raise ValueError(
                f"--tokenizer-model {model_file} is not a SentencePiece .model file ({exc}); for a "
                "HuggingFace tokenizer folder use --tokenizer-type HuggingFaceTokenizer "
                "--tokenizer-name-or-path DIR") from exc
        if self._sp.eos_id() < 0:
            raise ValueError(f"--tokenizer-model {model_file}: the model defines no </s> piece, needed "
                             "as the end-of-document id")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> Optional[int]:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def pad(self) -> Optional[int]:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> List[List[int]]:
        return self._sp.encode(list(texts), num_threads=num_threads)

    def tokenize_batch_flat(self, texts: Sequence[str], dtype=np.int64,
                            num_threads: int = 1) -> Tuple[np.ndarray, np.ndarray]:
        texts = list(texts)
        if not texts:
            return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
        # SentencePiece's batch encode hands back one int32 buffer per text (encode_as_numpy wraps
        # each in an array); joining the raw buffers once saves a NumPy call per document, which
        # is most of the preprocessor's own time on short documents. The raw call takes the
        # processor's default options (no sampling, no BOS/EOS, not reversed: set nowhere here);
        # a sentencepiece without it takes the public path.
        raw = getattr(getattr(self._sp, "_processor", None), "_EncodeAsBufferBatch", None)
        try:
            buffers = raw(texts, num_threads, None, False, 0, 0.0, False, False, False)
            lengths = np.fromiter(map(len, map(memoryview, buffers)), dtype=np.int64, count=len(buffers))
            flat = np.frombuffer(b"".join(buffers), dtype=np.int32)
        except TypeError:  # raw is None, or its signature changed
            buffers = self._sp.encode_as_numpy(texts, num_threads=num_threads)
            lengths = np.fromiter(map(len, buffers), dtype=np.int64, count=len(buffers))
            flat = np.concatenate(buffers)
        # unsafe: int32 -> uint16 is exact because the caller's dtype holds the vocabulary.
        return flat.astype(dtype, casting="unsafe", copy=False), lengths

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __getstate__(self):  # worker processes rebuild the processor from the file
        return {"model_file": self.model_file}

    def __setstate__(self, state):
        self.__init__(state["model_file"])


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron-LM's ``GPTSentencePieceTokenizer``: the same ids as ``SentencePieceTokenizer`` here."""

    name = "GPTSentencePieceTokenizer"


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's ``Llama2Tokenizer``: the LLaMA-2 ``.model``; documents encoded without BOS/EOS."""

    name = "Llama2Tokenizer"
