"""Indexed datasets written for data tests, and a plain port of Megatron's blending greedy."""

import numpy as np

from megatron.data.indexed_dataset import (MMapIndexedDatasetBuilder, data_file_path, index_file_path,
                                           write_index)


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


def placeholder_dataset(prefix, num_docs=1000, tokens_per_doc=300, dtype=np.uint16):
    """A valid pair of ``num_docs`` documents whose tokens are all 0: the ``.idx`` in full, the
    ``.bin`` a sparse file of the right length. For argument validation, which reads only the
    ``.idx`` (no disk space even for long sequences)."""
    with open(index_file_path(prefix), "wb") as f:
        write_index(f, dtype, np.full(num_docs, tokens_per_doc, np.int32),
                    np.arange(num_docs + 1, dtype=np.int64))
    with open(data_file_path(prefix), "wb") as f:
        f.truncate(num_docs * tokens_per_doc * np.dtype(dtype).itemsize)
    return prefix


def reference_blending(weights, size):
    """``build_blending_indices`` of Megatron's helpers.cpp, one step at a time."""
    counts = [0] * len(weights)
    dataset_index, sample_index = [], []
    for i in range(size):
        x = max(float(i), 1.0)
        errors = [w * x - c for w, c in zip(weights, counts)]
        best = 0
        for d in range(1, len(weights)):
            if errors[d] > errors[best]:
                best = d
        dataset_index.append(best)
        sample_index.append(counts[best])
        counts[best] += 1
    return np.array(dataset_index, np.int16), np.array(sample_index, np.int64)
