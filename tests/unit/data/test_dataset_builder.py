"""megatron.data.dataset_builder: splits, weighted and unweighted blends as Megatron-Core's
BlendedMegatronDatasetBuilder builds them, per-split paths, the checks argument validation runs
before the model is built, and rank 0 building the index caches first."""
import os

import numpy as np
import pytest

from megatron.data.blend_config import split_sources
from megatron.data.blended_dataset import BlendedDataset, normalize
from megatron.data.dataset_builder import (build_train_valid_test_datasets, check_train_valid_test_data,
                                           get_train_valid_test_num_samples, one_epoch_samples)
from megatron.data.gpt_dataset import GPTDataset, build_indices
from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.helpers.data import random_docs, reference_blending, write_dataset
from tests.helpers.dist import run_distributed


@pytest.fixture()
def two_prefixes(tmp_path):
    rng = np.random.RandomState(0)
    a = write_dataset(str(tmp_path / "a"), random_docs(rng, 40, vocab=100))
    b = write_dataset(str(tmp_path / "b"), [d + 1000 for d in random_docs(rng, 30, vocab=100)])
    return a, b


def _kw(tmp_path, **over):
    kw = dict(split="90,10,0", train_valid_test_num_samples=[50, 10, 0], seq_length=8, seed=3,
              data_cache_path=str(tmp_path / "cache"))
    kw.update(over)
    return kw


def test_num_samples_iteration_and_sample_based():
    assert get_train_valid_test_num_samples(global_batch_size=8, train_iters=100, eval_interval=50,
                                            eval_iters=2) == [800, 48, 16]
    assert get_train_valid_test_num_samples(global_batch_size=8, train_samples=804, eval_interval=50,
                                            eval_iters=2) == [804, 48, 16]


def test_single_prefix_splits(two_prefixes, tmp_path):
    a, _ = two_prefixes
    train, valid, test = build_train_valid_test_datasets(data_path=[a], **_kw(tmp_path))
    assert test is None
    assert isinstance(train, GPTDataset) and len(train) >= 50
    np.testing.assert_array_equal(train.documents, np.arange(0, 36))   # round(0.9 * 40) = 36
    np.testing.assert_array_equal(valid.documents, np.arange(36, 40))
    assert train[0]["text"].shape == (9,)


def test_split_is_built_as_validation_reads_it(tmp_path):
    """--split 1e2,1 over 101 documents: 100 training and 1 validation document (Megatron's regex
    read it as 1,2,1, i.e. 25/51/25); what validation accepts is what the builder builds."""
    prefix = write_dataset(str(tmp_path / "d"), [np.arange(20) for _ in range(101)])
    train, valid, test = build_train_valid_test_datasets(
        data_path=[prefix], **_kw(tmp_path, split="1e2,1", train_valid_test_num_samples=[10, 2, 2]))
    np.testing.assert_array_equal(train.documents, np.arange(100))
    np.testing.assert_array_equal(valid.documents, [100])
    assert test is None  # no share
    with pytest.raises(ValueError, match=r"^--split \(nan,1,1\): every share must be a finite number"):
        build_train_valid_test_datasets(data_path=[prefix], **_kw(tmp_path, split="nan,1,1"))


def test_weighted_blend_samples_come_from_the_datasets(two_prefixes, tmp_path):
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


@pytest.mark.parametrize("requested", [50, 10_000])
def test_unweighted_blend_as_megatron_builds_it(two_prefixes, tmp_path, requested):
    """--data-path A B: Megatron-Core's "weights is None, size given": each dataset one epoch
    (num_samples=None), blended by their lengths, min(requested, total) samples."""
    a, b = two_prefixes
    train, valid, _ = build_train_valid_test_datasets(
        data_path=[a, b], **_kw(tmp_path, train_valid_test_num_samples=[requested, 10, 0]))
    lengths = []
    for part, prefix, n in zip(train.datasets, (a, b), (40, 30)):
        ds = MMapIndexedDataset(prefix)
        docs = np.arange(round(0.9 * n), dtype=np.int32)
        tokens = int(ds.sizes[docs].sum())
        assert part.num_samples is None and len(part) == one_epoch_samples(tokens, 8) == (tokens - 1) // 8
        np.testing.assert_array_equal(part.shuffle_index, build_indices(ds.sizes, docs, 8, None, 3)[2])
        lengths.append(len(part))
    assert len(train) == min(requested, sum(lengths))
    ref_di, ref_dsi = reference_blending(normalize(lengths), len(train))
    np.testing.assert_array_equal(train.dataset_index, ref_di)
    np.testing.assert_array_equal(train.dataset_sample_index, ref_dsi)
    assert isinstance(valid, BlendedDataset) and len(valid) == 10


def test_per_split_paths_and_empty_splits(two_prefixes, tmp_path):
    a, b = two_prefixes
    train, valid, test = build_train_valid_test_datasets(
        data_path=None, train_data_path=["0.5", a, "0.5", b], valid_data_path=[b], test_data_path=None,
        **_kw(tmp_path, train_valid_test_num_samples=[20, 0, 5]))
    assert isinstance(train, BlendedDataset) and valid is None and test is None
    assert len(train.datasets[0].documents) == 40
    with pytest.raises(ValueError, match="mutually exclusive"):
        build_train_valid_test_datasets(data_path=[a], train_data_path=[b], **_kw(tmp_path))
    with pytest.raises(ValueError, match="no training data"):
        build_train_valid_test_datasets(data_path=None, **_kw(tmp_path))


def test_empty_test_split_is_left_out_empty_validation_split_is_an_error(two_prefixes, tmp_path):
    a, _ = two_prefixes
    # 969,30,1 of 40 documents: the test share round(0.999 * 40) .. 40 holds none.
    train, valid, test = build_train_valid_test_datasets(
        data_path=[a], **_kw(tmp_path, split="969,30,1", train_valid_test_num_samples=[10, 2, 2]))
    assert test is None and valid is not None
    with pytest.raises(ValueError, match=r"^--data-path \(.*a\) with --split 99,1: the valid split of .*a "
                                         r"holds 0 tokens \(sequences \[40, 40\) of 40\).*--split"):
        build_train_valid_test_datasets(
            data_path=[a], **_kw(tmp_path, split="99,1", train_valid_test_num_samples=[10, 2, 0]))


def test_unweighted_blend_leaves_out_a_share_without_a_sample(two_prefixes, tmp_path):
    """Its length (Megatron's weight) is 0: it contributes nothing (Megatron asserts on it); with
    weights the share cannot be honoured and is an error."""
    a, _ = two_prefixes
    one = write_dataset(str(tmp_path / "one"), [np.arange(20)])  # 90,10,0: valid share empty
    _, valid, _ = build_train_valid_test_datasets(data_path=[a, one], **_kw(tmp_path))
    assert isinstance(valid, BlendedDataset) and len(valid.datasets) == 1
    assert valid.datasets[0].dataset_path == a
    with pytest.raises(ValueError, match=r"the valid split of .*one holds 0 tokens"):
        build_train_valid_test_datasets(data_path=["1", a, "1", one], **_kw(tmp_path))


def test_bad_and_empty_datasets_named_with_their_flag(two_prefixes, tmp_path):
    a, b = two_prefixes
    damaged = write_dataset(str(tmp_path / "damaged"), random_docs(np.random.RandomState(1), 10))
    with open(damaged + ".bin", "r+b") as f:
        f.truncate(6)
    with pytest.raises(ValueError, match=r"^--valid-data-path \(.*damaged\), validation data: .*damaged\.bin: "
                                         r"6 bytes.*truncated"):
        build_train_valid_test_datasets(data_path=None, train_data_path=[a], valid_data_path=[damaged],
                                        **_kw(tmp_path))
    empty = write_dataset(str(tmp_path / "empty"), [])
    with pytest.raises(ValueError, match=r"^--data-path \(.*empty\) with --split 90,10,0, training data: "
                                         r"dataset .*empty holds no tokens \(0 sequences\)"):
        build_train_valid_test_datasets(data_path=["0.5", a, "0.5", empty], **_kw(tmp_path))


def test_checks_before_the_build(two_prefixes, tmp_path):
    """What validation runs (the .idx only, nothing written): the builder's own refusals, plus an
    unweighted blend too short for a run whose loader does not cycle."""
    a, b = two_prefixes
    sources = split_sources(data_path=[a, b], split="90,10,0")
    check_train_valid_test_data(sources, seq_length=8, num_samples=[50, 10, 0])
    with pytest.raises(ValueError, match=r"^--data-path \(.*a .*b\) with --split 90,10,0: without weights "
                                         r"each dataset is used for one epoch .* for the training split, "
                                         r"which needs 10000; give weights"):
        check_train_valid_test_data(sources, seq_length=8, num_samples=[10_000, 10, 0])
    check_train_valid_test_data(sources, seq_length=8, num_samples=[10_000, 10, 0], dataloader_type="cyclic")
    weighted = split_sources(data_path=["1", a, "1", b], split="90,10,0")
    check_train_valid_test_data(weighted, seq_length=8, num_samples=[10_000, 10, 0])
    with pytest.raises(ValueError, match=r"the train split of .*a holds \d+ tokens .* fewer than one sample "
                                         r"of --seq-length 5000"):
        check_train_valid_test_data(sources, seq_length=5000, num_samples=[1, 0, 0])
    assert not os.path.exists(tmp_path / "cache") and not os.path.exists(os.path.join(a, "cache"))


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
