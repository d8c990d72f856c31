"""Merge several MMIDIDX datasets into one, keeping every document boundary (Megatron's
``tools/merge_datasets.py``).

    python tools/merge_datasets.py --input data/shards --output-prefix data/all_text_document
    python tools/merge_datasets.py --input data/a_text_document data/b_text_document --output-prefix data/ab

``--input`` is a folder (every ``.bin``/``.idx`` pair in it, in sorted order, as Megatron does) or
a list of prefixes (merged in the order given). Byte offsets are int64, so a merged dataset beyond
2^31 tokens stays correct; the output is written under temporary names and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetError, MMapIndexedDataset, MMapIndexedDatasetBuilder, data_file_path, index_file_path)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="A folder of .bin/.idx pairs, or the prefixes to merge (without .bin/.idx).")
    parser.add_argument("--output-prefix", type=str, required=True,
                        help="Merged dataset: {prefix}.bin/.idx (no suffix is added).")
    return parser.parse_args(argv)


def input_prefixes(inputs: List[str]) -> List[str]:
    """Prefixes named by ``--input``.

    Raises:
        FileNotFoundError: a prefix lacks its ``.bin`` or ``.idx``, or a folder holds no pair.
    """
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        folder = inputs[0]
        names = sorted({os.path.splitext(n)[0] for n in os.listdir(folder) if n.endswith((".bin", ".idx"))})
        prefixes = [os.path.join(folder, n) for n in names]
        if not prefixes:
            raise FileNotFoundError(f"--input {folder}: the folder holds no .bin/.idx pairs")
    else:
        prefixes = list(inputs)
    for prefix in prefixes:
        if not MMapIndexedDataset.exists(prefix):
            missing = [p for p in (data_file_path(prefix), index_file_path(prefix)) if not os.path.isfile(p)]
            raise FileNotFoundError(f"--input {prefix}: missing {' and '.join(missing)} (give prefixes "
                                    "without .bin/.idx)")
    return prefixes


def merge(prefixes: List[str], output_prefix: str) -> MMapIndexedDataset:
    """Concatenates ``prefixes`` into ``output_prefix``; returns the merged dataset.

    Raises:
        ValueError: the inputs differ in token dtype, or the output is one of the inputs.
        IndexedDatasetError: an input is truncated or corrupted.
    """
    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out for p in prefixes):
        raise ValueError(f"--output-prefix {output_prefix} is one of the inputs; choose a new prefix")
    datasets = [MMapIndexedDataset(p) for p in prefixes]  # validates every input before writing
    dtypes = {ds.dtype.name for ds in datasets}
    if len(dtypes) > 1:
        listing = ", ".join(f"{p} ({ds.dtype.name})" for p, ds in zip(prefixes, datasets))
        raise ValueError(f"inputs have different token dtypes: {listing}; preprocess them with the same tokenizer")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with MMapIndexedDatasetBuilder(data_file_path(output_prefix), datasets[0].dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(index_file_path(output_prefix))
    return MMapIndexedDataset(output_prefix)


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        prefixes = input_prefixes(args.input)
        merged = merge(prefixes, args.output_prefix)
    except (FileNotFoundError, ValueError, IndexedDatasetError) as e:
        print(f"merge_datasets.py: error: {e}", file=sys.stderr)
        return 2  # argparse's status for a usage error: the input is the user's to fix
    print(f"Merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx: {len(merged.document_indices) - 1:,} "
          f"documents, {len(merged):,} sequences, {int(merged.sizes.sum(dtype='int64')):,} tokens ({merged.dtype.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
