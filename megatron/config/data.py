"""The data section of the configuration: datasets, loading, masks and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DataConfig:
    """Datasets, loading and the tokenizer. ``--data-path`` blends and ``--split`` are parsed by
    ``megatron.data.blend_config`` (``split_sources``), for validation and the builder alike; path
    lists are tuples."""

    seq_length: int
    """``--seq-length``: tokens per sample. Required."""
    data_path: Optional[tuple] = None
    """``--data-path``: ``PREFIX ...`` or ``WEIGHT PREFIX ...`` (a blend), split by ``--split``;
    default None (then ``--train-data-path`` is required)."""
    train_data_path: Optional[tuple] = None
    """``--train-data-path``: the training split's prefixes (instead of ``--data-path``); default
    None."""
    valid_data_path: Optional[tuple] = None
    """``--valid-data-path``: the validation split's prefixes; default None."""
    test_data_path: Optional[tuple] = None
    """``--test-data-path``: the test split's prefixes; default None."""
    mock_data: bool = False
    """``--mock-data``: synthetic tokens instead of a dataset (``megatron.data.mock_dataset``);
    excludes the data paths. Default off."""
    split: str = "969, 30, 1"
    """``--split``: train, valid, test proportions of ``--data-path``. Default ``969, 30, 1``."""
    data_cache_path: Optional[str] = None
    """``--data-cache-path``: folder of the sample-index cache; default beside the data."""
    dataloader_type: str = "single"
    """``--dataloader-type``: single (one pass) or cyclic. Default single."""
    num_workers: int = 2
    """``--num-workers``: data-loader worker processes. Default 2."""
    eod_mask_loss: bool = False
    """``--eod-mask-loss``: no loss on end-of-document tokens. Default off."""
    reset_position_ids: bool = False
    """``--reset-position-ids``: position ids restart after each end-of-document. Default off."""
    reset_attention_mask: bool = False
    """``--reset-attention-mask``: no attention across documents. Default off."""
    tokenizer_type: Optional[str] = None
    """``--tokenizer-type``: which tokenizer (``megatron.tokenizer.TOKENIZER_TYPES``). Required."""
    tokenizer_model: Optional[str] = None
    """``--tokenizer-model``: SentencePiece ``.model`` file; default None (required by the
    SentencePiece types)."""
    tokenizer_name_or_path: Optional[str] = None
    """``--tokenizer-name-or-path``: local HuggingFace tokenizer folder; default None (required by
    HuggingFaceTokenizer)."""
    vocab_file: Optional[str] = None
    """``--vocab-file``: GPT-2 ``vocab.json``; default None (required by GPT2BPETokenizer)."""
    merge_file: Optional[str] = None
    """``--merge-file``: GPT-2 ``merges.txt``; default None (required by GPT2BPETokenizer)."""
    vocab_size: Optional[int] = None
    """``--vocab-size``: ids of the NullTokenizer; default None (required by NullTokenizer)."""
    make_vocab_size_divisible_by: int = 128
    """``--make-vocab-size-divisible-by``: the vocabulary is padded to a multiple of this x TP.
    Default 128."""
