"""Tokenizers selected by ``--tokenizer-type`` (Megatron's names) and the padded vocabulary size.

Importing this package loads no tokenizer library and no torch; ``build_tokenizer`` imports the one
it needs.
"""

from .base import AbstractTokenizer
from .tokenizer import TOKENIZER_TYPES, add_tokenizer_args, build_tokenizer, vocab_size_with_padding

__all__ = ["AbstractTokenizer", "TOKENIZER_TYPES", "add_tokenizer_args", "build_tokenizer",
           "vocab_size_with_padding"]
