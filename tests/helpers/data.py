"""Indexed datasets written for data tests."""

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, data_file_path, index_file_path


# ---------------------------------------------------------------- samples from a real dataset
def write_dataset(prefix, docs, dtype=np.uint16):
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype)
    for doc in docs:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return prefix


def random_docs(rng, n, max_len=30, vocab=1000):
    return [rng.randint(0, vocab, size=rng.randint(1, max_len)) for _ in range(n)]
