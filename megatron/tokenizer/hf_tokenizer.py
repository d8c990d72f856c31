"""Tokenizers run by the HuggingFace ``tokenizers`` library: ``HuggingFaceTokenizer`` and ``GPT2BPETokenizer``.

Only local files are read; nothing is downloaded from the hub, and no code shipped with a
tokenizer folder is run (:func:`megatron.hf_folder.refuse_custom_code`).
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence

from megatron.hf_folder import refuse_custom_code

from .base import AbstractTokenizer


class _LibTokenizer(AbstractTokenizer):
    """Shared encode/decode over a ``tokenizers.Tokenizer`` (``self._tok``)."""

    _add_special_tokens = True
    _eod: Optional[int] = None
    _bos: Optional[int] = None
    _pad: Optional[int] = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise ValueError(f"{self.name} {self.source}: no end-of-document token (eos_token) is "
                             "defined, so --append-eod cannot be used")
        return self._eod

    @property
    def bos(self) -> Optional[int]:
        return self._bos

    @property
    def pad(self) -> Optional[int]:
        return self._pad

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=self._add_special_tokens).ids

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> List[List[int]]:
        if num_threads == 1:  # encode_batch would start the library's thread pool on every core
            return [self._tok.encode(t, add_special_tokens=self._add_special_tokens).ids for t in texts]
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=self._add_special_tokens)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _token_content(value) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value


class HuggingFaceTokenizer(_LibTokenizer):
    """A tokenizer saved by HuggingFace in a local folder (``--tokenizer-name-or-path DIR``).

    Encodes as ``transformers`` does by default (``tokenizer(text).input_ids``: special tokens of the
    tokenizer's post-processor, e.g. LLaMA's BOS, included). ``eod`` is the ``eos_token`` of
    ``tokenizer_config.json`` / ``special_tokens_map.json`` (Megatron's ``_HuggingFaceTokenizer``).
    A folder with ``tokenizer.json`` is read by the ``tokenizers`` library alone; a folder with only
    SentencePiece files is converted once through ``transformers.AutoTokenizer`` (local files only).

    Raises:
        FileNotFoundError: ``path`` is not a local folder holding a tokenizer.
        ValueError: the folder asks to run its own code (``auto_map``, ``*.py``): refused before
            anything is read, so ``transformers`` never asks on standard input.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        if not path or not os.path.isdir(path):
            raise FileNotFoundError(
                f"--tokenizer-name-or-path {path!r}: not a local folder. Hub downloads are not done here; "
                "fetch it first (e.g. `huggingface-cli download NAME --local-dir DIR`) and pass DIR")
        refuse_custom_code(path, "--tokenizer-name-or-path")
        self.source = path
        self._build(path)

    def _build(self, path: str) -> None:
        from tokenizers import Tokenizer

        special = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
            file = os.path.join(path, name)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as f:
                    special.update({k: _token_content(v) for k, v in json.load(f).items()
                                    if k in ("bos_token", "eos_token", "pad_token")})
        tokenizer_json = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tokenizer_json):
            self._tok = Tokenizer.from_file(tokenizer_json)
        else:
            try:
                from transformers import AutoTokenizer

                fast = AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True,
                                                     trust_remote_code=False)
            except Exception as e:
                raise FileNotFoundError(f"--tokenizer-name-or-path {path}: no tokenizer.json, and "
                                        f"transformers could not load the folder ({e})") from e
            self._tok = fast.backend_tokenizer
            special = {"bos_token": fast.bos_token, "eos_token": fast.eos_token, "pad_token": fast.pad_token,
                       **{k: v for k, v in special.items() if v is not None}}
        self._bos, self._eod, self._pad = (
            self._tok.token_to_id(special[k]) if special.get(k) else None
            for k in ("bos_token", "eos_token", "pad_token"))

    def __getstate__(self):
        return {"source": self.source}

    def __setstate__(self, state):
        self.__init__(state["source"])


class GPT2BPETokenizer(_LibTokenizer):
    """GPT-2 byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file`` (merges.txt).

    The ids equal Megatron's ``_GPT2BPETokenizer``; ``eod`` is ``<|endoftext|>``, which in text is
    tokenized as plain characters, as Megatron does.

    Raises:
        FileNotFoundError: either file is missing.
        ValueError: the vocabulary has no ``<|endoftext|>``.
    """

    name = "GPT2BPETokenizer"
    _add_special_tokens = False

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, file in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not file or not os.path.isfile(file):
                raise FileNotFoundError(f"{flag} {file!r}: file not found (GPT2BPETokenizer needs "
                                        "--vocab-file vocab.json and --merge-file merges.txt)")
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self.source = vocab_file
        self._files = (vocab_file, merge_file)
        self._tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self._eod = self._tok.token_to_id("<|endoftext|>")
        if self._eod is None:
            raise ValueError(f"--vocab-file {vocab_file}: no <|endoftext|> token, needed as end-of-document")

    def __getstate__(self):
        return {"files": self._files}

    def __setstate__(self, state):
        self.__init__(*state["files"])
