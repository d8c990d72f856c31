"""Token ids checked against the vocabulary when the datasets are named, where that is cheap.

A token id at or above the vocabulary size indexes past the embedding (or silently trains a
padding row); a negative one (a signed ``.bin``) likewise. The batch check in
``pretrain_llama.py`` catches it when the batch is read, after the model is built and possibly
hours in; here every ``.bin`` of at most :data:`SCAN_LIMIT_BYTES` is read once at start (the
lowest and highest id, in blocks of 16 MiB: 40 ms per 100 MB from the page cache on a busy
2-core machine), so a dataset tokenized with another tokenizer is refused before anything is
built, naming its flag and file. Larger files are left to the batch check.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron.data.blend_config import split_sources
from megatron.data.indexed_dataset import MMapIndexedDataset, data_file_path

SCAN_LIMIT_BYTES = 256 << 20


def dataset_flags(*, data_path: Optional[Sequence[str]], split: str,
                  train_data_path=None, valid_data_path=None, test_data_path=None) -> list:
    """``[(flag, prefix)]`` of every dataset the run reads, each once, under the flag that names
    it (``--data-path`` or ``--train/valid/test-data-path``)."""
    pairs = []
    for source in split_sources(data_path=data_path, split=split,
                                train_data_path=train_data_path,
                                valid_data_path=valid_data_path, test_data_path=test_data_path):
        if source is None:
            continue
        for prefix in source.blend.prefixes:
            if (source.blend.flag, prefix) not in pairs:
                pairs.append((source.blend.flag, prefix))
    return pairs


def out_of_vocabulary(flag: str, prefix: str, vocab_size: int,
                      limit_bytes: int = SCAN_LIMIT_BYTES) -> Optional[str]:
    """The message when the ``.bin`` of ``prefix`` holds an id outside ``[0, vocab_size)``,
    else None (also when the file is larger than ``limit_bytes``: not read)."""
    found = MMapIndexedDataset(prefix).token_range(limit_bytes)
    if found is None:
        return None
    low, high = found
    if low >= 0 and high < vocab_size:
        return None
    bad = high if high >= vocab_size else low
    return (f"{flag} ({prefix}): token id {bad} in {data_file_path(prefix)} is outside the "
            f"vocabulary [0, {vocab_size})")


def check_token_ranges(vocab_size: int, tokenizer_flags: str, *, data_path, split,
                       train_data_path=None, valid_data_path=None, test_data_path=None,
                       limit_bytes: int = SCAN_LIMIT_BYTES) -> None:
    """Refuse the first dataset of the run whose ids leave the vocabulary (files up to
    ``limit_bytes``; see the module's docstring).

    Args:
        tokenizer_flags: the run's tokenizer flags, named in the message.

    Raises:
        ValueError: naming the flag, the file, the id, the vocabulary and the fix.
    """
    for flag, prefix in dataset_flags(data_path=data_path, split=split,
                                      train_data_path=train_data_path,
                                      valid_data_path=valid_data_path,
                                      test_data_path=test_data_path):
        message = out_of_vocabulary(flag, prefix, vocab_size, limit_bytes)
        if message:
            raise ValueError(f"{message} of {tokenizer_flags}: the data was tokenized with "
                             "another tokenizer; pass that tokenizer's flags, or re-run "
                             "tools/preprocess_data.py with this one")
