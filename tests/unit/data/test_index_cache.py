"""megatron.data.index_cache: a damaged cached index (--data-cache-path) is detected, named in a
warning and rebuilt, through the datasets that use it."""
import logging
import os

import numpy as np
import pytest

from megatron.data.blended_dataset import BlendedDataset
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.index_cache import IndexCache
from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.helpers.data import random_docs, write_dataset


@pytest.fixture()
def dataset(tmp_path):
    prefix = write_dataset(str(tmp_path / "c"), random_docs(np.random.RandomState(0), 30))
    return MMapIndexedDataset(prefix), prefix, str(tmp_path / "cache")


def _gpt(dataset):
    ds, prefix, cache = dataset
    return GPTDataset(ds, prefix, np.arange(len(ds), dtype=np.int32), 60, 8, 1, cache_dir=cache)


def _flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("damage", ["flipped byte", "other array of the same shape", "no checksums",
                                    "missing array", "truncated array"])
def test_damaged_cache_is_named_and_rebuilt(dataset, caplog, damage):
    first = _gpt(dataset)
    assert first.built_anew and not _gpt(dataset).built_anew
    path = first.cache.path("shuffle_index.npy")
    if damage == "flipped byte":
        _flip_last_byte(path)
    elif damage == "other array of the same shape":
        np.save(path, np.arange(len(first.shuffle_index), dtype=first.shuffle_index.dtype))
    elif damage == "no checksums":
        os.remove(first.cache.path("checksums.json"))
    elif damage == "missing array":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 8)
    with caplog.at_level(logging.WARNING, logger="megatron.data.index_cache"):
        again = _gpt(dataset)
    assert again.built_anew
    assert first.cache.cache_dir in caplog.text and "rebuilding" in caplog.text
    np.testing.assert_array_equal(again.shuffle_index, first.shuffle_index)
    assert not _gpt(dataset).built_anew  # the rebuilt set is whole again


def test_damaged_blend_cache_is_rebuilt(dataset, caplog):
    parts = [_gpt(dataset), _gpt(dataset)]
    blend = BlendedDataset(parts, [0.4, 0.6], 50, cache_dir=dataset[2])
    _flip_last_byte(blend.cache.path("dataset_sample_index.npy"))
    with caplog.at_level(logging.WARNING, logger="megatron.data.index_cache"):
        again = BlendedDataset(parts, [0.4, 0.6], 50, cache_dir=dataset[2])
    assert again.built_anew and "dataset_sample_index.npy: damaged" in caplog.text
    np.testing.assert_array_equal(again.dataset_sample_index, blend.dataset_sample_index)


def test_checksums_cover_dtype_and_shape(tmp_path):
    cache = IndexCache(str(tmp_path), "X-train", "{}", ["a"])
    cache.save({"a": np.arange(6, dtype=np.int32)})
    assert cache.load()["a"].tolist() == list(range(6))
    np.save(cache.path("a.npy"), np.arange(6, dtype=np.int64))  # same values, other dtype
    assert cache.load() is None
    np.save(cache.path("a.npy"), np.arange(6, dtype=np.int32).reshape(2, 3))
    assert cache.load() is None
