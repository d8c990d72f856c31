"""Tokenizer selection from ``--tokenizer-type`` and Megatron's padded vocabulary size."""

from __future__ import annotations

import argparse

from .base import AbstractTokenizer

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "PretrainedFromHF",
    "GPT2BPETokenizer",
    "NullTokenizer",
)


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds Megatron's tokenizer flags (shared by ``tools/preprocess_data.py`` and the trainer).

    Flags: ``--tokenizer-type``, ``--tokenizer-model``, ``--tokenizer-name-or-path``,
    ``--vocab-file``, ``--merge-file``, ``--vocab-size``. ``--make-vocab-size-divisible-by`` is not
    here: it belongs to the trainer's network-size flags, as in Megatron-LM.
    """
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, default=None, choices=TOKENIZER_TYPES,
                       help="Which tokenizer to use.")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="SentencePiece .model file (SentencePiece/GPTSentencePiece/Llama2Tokenizer).")
    group.add_argument("--tokenizer-name-or-path", type=str, default=None,
                       help="Local folder of a HuggingFace tokenizer (HuggingFaceTokenizer); no hub download.")
    group.add_argument("--vocab-file", type=str, default=None, help="GPT-2 vocab.json (GPT2BPETokenizer).")
    group.add_argument("--merge-file", type=str, default=None, help="GPT-2 merges.txt (GPT2BPETokenizer).")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="Number of ids of the NullTokenizer (its end-of-document id is this value).")
    return parser


def build_tokenizer(args) -> AbstractTokenizer:
    """Builds the tokenizer named by ``args.tokenizer_type``.

    Args:
        args: a namespace with ``tokenizer_type`` and the fields its type needs: ``tokenizer_model``
            (SentencePiece types), ``tokenizer_name_or_path`` (HuggingFaceTokenizer; falls back to
            ``tokenizer_model`` as Megatron-LM passes it), ``vocab_file`` + ``merge_file``
            (GPT2BPETokenizer), ``vocab_size`` (NullTokenizer). Missing fields count as None.

    Raises:
        ValueError: no or an unknown ``--tokenizer-type``, or a flag its type needs is missing.
        FileNotFoundError: a tokenizer file or folder does not exist.
    """
    kind = getattr(args, "tokenizer_type", None)
    get = lambda name: getattr(args, name, None)  # noqa: E731
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        from . import sp_tokenizer

        if not get("tokenizer_model"):
            raise ValueError(f"--tokenizer-type {kind} needs --tokenizer-model PATH (a SentencePiece .model file)")
        return getattr(sp_tokenizer, kind)(get("tokenizer_model"))
    if kind in ("HuggingFaceTokenizer", "PretrainedFromHF"):
        from .hf_tokenizer import HuggingFaceTokenizer

        path = get("tokenizer_name_or_path") or get("tokenizer_model")
        if not path:
            raise ValueError(f"--tokenizer-type {kind} needs --tokenizer-name-or-path DIR (a local folder)")
        return HuggingFaceTokenizer(path)
    if kind == "GPT2BPETokenizer":
        from .hf_tokenizer import GPT2BPETokenizer

        return GPT2BPETokenizer(get("vocab_file"), get("merge_file"))
    if kind == "NullTokenizer":
        from .null_tokenizer import NullTokenizer

        return NullTokenizer(get("vocab_size"))
    raise ValueError(f"--tokenizer-type {kind!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}")


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int,
                            tensor_model_parallel_size: int) -> int:
    """Vocabulary rows of the embedding: ``orig_vocab_size`` rounded up to a multiple of
    ``make_vocab_size_divisible_by * tensor_model_parallel_size`` (Megatron's
    ``_vocab_size_with_padding``), so every tensor-parallel partition has equal, aligned rows.

    Raises:
        ValueError: an argument is not positive.
    """
    for flag, value in (("vocab size", orig_vocab_size),
                        ("--make-vocab-size-divisible-by", make_vocab_size_divisible_by),
                        ("--tensor-model-parallel-size", tensor_model_parallel_size)):
        if int(value) <= 0:
            raise ValueError(f"{flag} must be positive (got {value})")
    multiple = int(make_vocab_size_divisible_by) * int(tensor_model_parallel_size)
    return -(-int(orig_vocab_size) // multiple) * multiple
