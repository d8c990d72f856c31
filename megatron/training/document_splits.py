"""One tokens dataset's documents (conversations, preference pairs) cut into train, validation
and test datasets by ``--split``, as Megatron-Core cuts documents; the post-training stages'
datasets providers (finetune_llama.py, megatron/training/pairs.py) build theirs with it. It
lives here, not in megatron/data/, because it logs (megatron/data/ imports nothing from
megatron/training/)."""

from __future__ import annotations

import numpy as np

from megatron.data.blend_config import parse_split, split_matrix
from megatron.data.dataset_builder import _rank_zero_first
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.training.logging import print_rank_0


def split_datasets(config, train_val_test_num_samples, what: str, make) -> tuple:
    """``(train, valid, test)`` datasets of ``--data-path``'s documents (conversations or pairs)
    cut by ``--split`` as Megatron-Core cuts documents: ``make(split_name, documents, samples)``
    for each part with documents and samples asked, None for the others; built by global rank 0
    first (index caches). ``what``: the documents' name and kind, for the log line."""
    prefix = str(config.data.data_path[0])
    count = len(MMapIndexedDataset(prefix).document_indices) - 1
    print_rank_0(f" > building {what.format(count=count)} train, validation, and test datasets "
                 f"of {prefix} ...")

    def build():
        out = []
        for name, span, n in zip(("train", "valid", "test"),
                                 split_matrix(parse_split(config.data.split)),
                                 train_val_test_num_samples):
            lo, hi = (0, 0) if span is None else (round(span[0] * count), round(span[1] * count))
            out.append(make(name, np.arange(lo, hi), n) if n > 0 and hi > lo else None)
        return tuple(out)

    return _rank_zero_first(build)
