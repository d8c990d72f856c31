"""Blending order against a plain port of Megatron's greedy; blends, splits and the builder."""
import os

import numpy as np
import pytest

from megatron.data.blended_dataset import BlendedDataset, build_blending_indices, get_size_per_dataset, normalize
from megatron.data.dataset_builder import (build_train_valid_test_datasets, get_train_valid_test_num_samples,
                                           parse_data_path, parse_split, split_bookends)
from megatron.data.gpt_dataset import GPTDataset
from tests.helpers.data import random_docs, write_dataset
from tests.helpers.dist import run_distributed
from tests.helpers.paths import FIXTURES

FIXTURE = os.path.join(FIXTURES, "blending_indices.npz")


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


BLENDS = {"two": ([0.3, 0.7], 5000), "three_equal": ([1, 1, 1], 3000), "four": ([1, 2, 3, 4], 3000),
          "skewed": ([0.999, 0.001], 5000), "random7": (list(np.random.RandomState(0).rand(7)), 3000),
          "single": ([5.0], 10)}


def generate_fixture(path=FIXTURE):
    arrays = {}
    for name, (w, size) in BLENDS.items():
        di, dsi = reference_blending(normalize(w), size)
        arrays[f"{name}/dataset_index"], arrays[f"{name}/dataset_sample_index"] = di, dsi
    np.savez_compressed(path, **arrays)


@pytest.mark.parametrize("name", list(BLENDS))
def test_blending_equals_megatron_greedy(name):
    weights, size = BLENDS[name]
    w = normalize(weights)
    with np.load(FIXTURE) as golden:
        gi, gsi = golden[f"{name}/dataset_index"], golden[f"{name}/dataset_sample_index"]
    ri, rsi = reference_blending(w, size)
    np.testing.assert_array_equal(ri, gi)
    np.testing.assert_array_equal(rsi, gsi)
    di, dsi = build_blending_indices(w, size)
    assert di.dtype == np.int16 and dsi.dtype == np.int64
    np.testing.assert_array_equal(di, gi)
    np.testing.assert_array_equal(dsi, gsi)
    # Greedy property: after every prefix of n samples each count is within 1 of w * n.
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[di], axis=0)
    n = np.arange(1, size + 1)[:, None]
    assert np.all(np.abs(counts - np.array(w)[None, :] * n) <= 1.0 + 1e-9)
    # Sample indices of each dataset run 0, 1, 2, ...
    for d in range(len(w)):
        np.testing.assert_array_equal(dsi[di == d], np.arange(np.sum(di == d)))


def test_sizes_per_dataset_with_megatron_margin():
    targets, buffers = get_size_per_dataset([0.3, 0.7], 1000)
    assert targets == [300, 700] and buffers == [302, 704]
    targets, buffers = get_size_per_dataset(normalize([1, 1, 1]), 10)
    assert targets == [4, 4, 4] and buffers == [5, 5, 5]


# ---------------------------------------------------------------- bad blends
@pytest.fixture()
def two_prefixes(tmp_path):
    rng = np.random.RandomState(0)
    a = write_dataset(str(tmp_path / "a"), random_docs(rng, 40, vocab=100))
    b = write_dataset(str(tmp_path / "b"), [d + 1000 for d in random_docs(rng, 30, vocab=100)])
    return a, b


def test_parse_data_path(two_prefixes):
    a, b = two_prefixes
    assert parse_data_path([a]) == ([a], None)
    prefixes, weights = parse_data_path(["0.3", a, "0.7", b])
    assert prefixes == [a, b] and np.allclose(weights, [0.3, 0.7])
    assert np.allclose(parse_data_path(["3", a, "7", b])[1], [0.3, 0.7])


@pytest.mark.parametrize("entries,match", [
    ([], "empty"),
    (["0.3", "A", "0.7"], "3 entries"),
    (["0.3", "A", "0", "B"], "weight 0 of B"),
    (["0.3", "A", "-1", "B"], "weight -1 of B"),
    (["0.3", "A", "nan", "B"], "weight nan of B"),
    (["A", "B"], "entry 1 .* must be a weight before the prefix"),
])
def test_malformed_blends(two_prefixes, entries, match):
    a, b = two_prefixes
    entries = [a if e == "A" else b if e == "B" else e for e in entries]
    match = match.replace("of B", f"of {b}")
    with pytest.raises(ValueError, match=match):
        parse_data_path(entries)


def test_missing_dataset_named(two_prefixes, tmp_path):
    a, _ = two_prefixes
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=f"--train-data-path: dataset '{missing}' not found"):
        parse_data_path(["0.5", a, "0.5", missing], flag="--train-data-path")


def test_split_parsing():
    assert parse_split("98,2,0") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert split_bookends([0.98, 0.02, 0.0])[2] is None
    for bad in ("", "0,0,0", "1,1,1,1"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def test_num_samples_iteration_and_sample_based():
    assert get_train_valid_test_num_samples(global_batch_size=8, train_iters=100, eval_interval=50,
                                            eval_iters=2) == [800, 48, 16]
    assert get_train_valid_test_num_samples(global_batch_size=8, train_samples=804, eval_interval=50,
                                            eval_iters=2) == [804, 48, 16]


# ---------------------------------------------------------------- builder
def _kw(tmp_path, **over):
    kw = dict(split="90,10,0", train_valid_test_num_samples=[50, 10, 0], seq_length=8, seed=3,
              data_cache_path=str(tmp_path / "cache"))
    kw.update(over)
    return kw


def test_single_prefix_splits(two_prefixes, tmp_path):
    a, _ = two_prefixes
    train, valid, test = build_train_valid_test_datasets(data_path=[a], **_kw(tmp_path))
    assert test is None
    assert isinstance(train, GPTDataset) and len(train) >= 50
    np.testing.assert_array_equal(train.documents, np.arange(0, 36))   # round(0.9 * 40) = 36
    np.testing.assert_array_equal(valid.documents, np.arange(36, 40))
    assert train[0]["text"].shape == (9,)


def test_blend_samples_come_from_the_datasets(two_prefixes, tmp_path):
    a, b = two_prefixes
    train, valid, _ = build_train_valid_test_datasets(data_path=["0.3", a, "0.7", b], **_kw(tmp_path))
    assert isinstance(train, BlendedDataset) and len(train) == 15 + 35
    assert [len(d) >= n for d, n in zip(train.datasets, (16, 36))] == [True, True]
    assert train.datasets[0].num_samples == 16 and train.datasets[1].num_samples == 36  # 1.005 margin
    ref_di, ref_dsi = reference_blending([0.3, 0.7], 50)
    np.testing.assert_array_equal(train.dataset_index, ref_di)
    for i in range(len(train)):
        d, s = ref_di[i], ref_dsi[i]
        np.testing.assert_array_equal(train[i]["text"], train.datasets[d][s]["text"])
        assert (train[i]["text"] >= 1000).all() == (d == 1)
    assert len(valid) == 3 + 7
    # Cached under --data-cache-path and reused.
    again = build_train_valid_test_datasets(data_path=["0.3", a, "0.7", b], **_kw(tmp_path))[0]
    assert not again.built_anew and not any(d.built_anew for d in again.datasets)
    np.testing.assert_array_equal(again.dataset_sample_index, train.dataset_sample_index)


def test_per_split_paths_and_empty_splits(two_prefixes, tmp_path):
    a, b = two_prefixes
    train, valid, test = build_train_valid_test_datasets(
        data_path=None, train_data_path=["0.5", a, "0.5", b], valid_data_path=[b], test_data_path=None,
        **_kw(tmp_path, train_valid_test_num_samples=[20, 0, 5]))
    assert isinstance(train, BlendedDataset) and valid is None and test is None
    assert len(train.datasets[0].documents) == 40
    with pytest.raises(ValueError, match="cannot be combined"):
        build_train_valid_test_datasets(data_path=[a], train_data_path=[b], **_kw(tmp_path))
    with pytest.raises(ValueError, match="no data"):
        build_train_valid_test_datasets(data_path=None, **_kw(tmp_path))


def test_cache_beside_the_data_by_default(two_prefixes, tmp_path):
    a, _ = two_prefixes
    build_train_valid_test_datasets(data_path=[a], **_kw(tmp_path, data_cache_path=None))
    files = os.listdir(os.path.join(a, "cache", "GPTDataset_indices"))
    assert sum(f.endswith("description.txt") for f in files) == 2  # train and valid


def _build_on_rank(a, b, cache):
    import torch.distributed as dist
    train, _, _ = build_train_valid_test_datasets(
        data_path=["0.3", a, "0.7", b], split="1", train_valid_test_num_samples=[30, 0, 0], seq_length=8,
        seed=1, data_cache_path=cache)
    return dist.get_rank(), train.built_anew, [d.built_anew for d in train.datasets], \
        train[29]["text"].tolist()


def test_rank_zero_builds_others_load(two_prefixes, tmp_path):
    a, b = two_prefixes
    results = run_distributed(2, _build_on_rank, a, b, str(tmp_path / "cache"), timeout=60)
    assert results[0][1:3] == (True, [True, True])
    assert results[1][1:3] == (False, [False, False])
    assert results[0][3] == results[1][3]


if __name__ == "__main__":
    generate_fixture()
    print("wrote", FIXTURE)
