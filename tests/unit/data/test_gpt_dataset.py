"""GPT dataset indices and samples against a plain loop port of Megatron-Core's construction.

``reference_indices`` below follows Megatron-Core line by line (``GPTDataset._get_num_epochs``,
``_build_document_index`` with ``numpy.mgrid``, ``build_sample_idx`` of ``helpers.cpp`` as a
``while`` loop, ``_build_shuffle_index``); ``tests/helpers/fixtures/gpt_indices.npz`` holds its arrays for
the cases in ``CASES``, computed once (regenerate with ``python tests/unit/data/test_gpt_dataset.py``), so a
change of either implementation or of numpy's ``RandomState`` stream is caught.
"""
import os

import numpy as np
import pytest

from megatron.data.gpt_dataset import GPTDataset, build_indices
from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.helpers.data import random_docs, write_dataset
from tests.helpers.paths import FIXTURES

FIXTURE = os.path.join(FIXTURES, "gpt_indices.npz")


# ---------------------------------------------------------------- reference (plain loops)
def reference_indices(sizes, documents, seq_length, num_samples, seed):
    tokens_per_epoch = int(sum(int(sizes[d]) for d in documents))
    num_epochs, num_tokens = 1, tokens_per_epoch
    while num_tokens < num_samples * seq_length + 1:
        num_epochs += 1
        num_tokens += tokens_per_epoch
    separate_final_epoch = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = from_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)

    def doc_index(epochs, separate):
        if not separate or epochs == 1:
            di = np.mgrid[0:epochs, 0:len(documents)][1]
            di[:] = documents
            di = di.reshape(-1).astype(np.int32)
            rng.shuffle(di)
            return di
        return np.concatenate((doc_index(epochs - 1, False), doc_index(1, False)))

    document_index = doc_index(num_epochs, separate_final_epoch)

    # helpers.cpp build_sample_idx, drop_last_partial_sequence=True, add_extra_token_to_sequence=1
    n = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = [(0, 0)]
    d, doc_offset = 0, 0
    while len(sample_index) <= n:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[document_index[d]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                assert d != len(document_index) - 1
                d += 1
                doc_offset = 0
        sample_index.append((d, doc_offset))
    sample_index = np.array(sample_index, dtype=np.int32)

    def shuffle(count, total):
        first = np.arange(count, dtype=np.uint32)
        rng.shuffle(first)
        if count == total:
            return first
        last = np.arange(count, total, dtype=np.uint32)
        rng.shuffle(last)
        return np.concatenate((first, last))

    total = len(sample_index) - 1
    shuffle_index = shuffle(sans_final if separate_final_epoch else total, total)
    return document_index, sample_index, shuffle_index, separate_final_epoch


def _case_sizes(kind, rng):
    if kind == "random":
        return rng.randint(1, 40, size=50).astype(np.int32)
    if kind == "with_empty":  # empty documents, including the first
        s = rng.randint(1, 12, size=30).astype(np.int32)
        s[[0, 3, 4, 17]] = 0
        return s
    if kind == "exact":  # documents of seq_length + 1 tokens: samples end on a document's last token
        return np.full(20, 9, dtype=np.int32)
    raise ValueError(kind)


# name: (sizes kind, documents slice, seq_length, num_samples, seed)
CASES = {
    "one_epoch": ("random", (0, 50), 16, 20, 1234),
    "epochs_joined": ("random", (0, 50), 16, 240, 7),       # final epoch large: one shuffle
    "epochs_separate": ("random", (0, 50), 16, 130, 7),     # final epoch small: shuffled apart
    "split_subset": ("random", (10, 45), 8, 300, 99),
    "with_empty": ("with_empty", (0, 30), 5, 70, 3),
    "exact_ends": ("exact", (0, 20), 8, 50, 5),
    "long_samples": ("random", (0, 50), 64, 40, 11),
}


def case_inputs(name):
    kind, (beg, end), seq_length, num_samples, seed = CASES[name]
    sizes = _case_sizes(kind, np.random.RandomState(len(name)))
    return sizes, np.arange(beg, end, dtype=np.int32), seq_length, num_samples, seed


def generate_fixture(path=FIXTURE):
    arrays = {}
    for name in CASES:
        doc, sample, shuffle, _ = reference_indices(*case_inputs(name))
        arrays.update({f"{name}/document_index": doc, f"{name}/sample_index": sample,
                       f"{name}/shuffle_index": shuffle})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, **arrays)


# ---------------------------------------------------------------- index arrays
@pytest.fixture(scope="module")
def golden():
    with np.load(FIXTURE) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("name", list(CASES))
def test_indices_equal_golden_and_reference(name, golden):
    inputs = case_inputs(name)
    ref = reference_indices(*inputs)[:3]
    ours = build_indices(*inputs)
    for label, r, o in zip(("document_index", "sample_index", "shuffle_index"), ref, ours):
        g = golden[f"{name}/{label}"]
        np.testing.assert_array_equal(r, g, err_msg=f"reference drifted from golden {label}")
        assert o.dtype == g.dtype, label
        np.testing.assert_array_equal(o, g, err_msg=label)


def test_cases_cover_both_final_epoch_rules():
    flags = {name: reference_indices(*case_inputs(name))[3] for name in ("epochs_joined", "epochs_separate")}
    assert flags == {"epochs_joined": False, "epochs_separate": True}


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("seq_length", [1, 3, 7, 32])
def test_indices_random_configs(seed, seq_length):
    rng = np.random.RandomState(100 + seed)
    sizes = rng.randint(0, 20, size=rng.randint(3, 40)).astype(np.int32)
    sizes[rng.randint(len(sizes))] = 5  # at least one token
    beg = rng.randint(len(sizes))
    documents = np.arange(beg, len(sizes), dtype=np.int32)
    if sizes[documents].sum() == 0:
        documents = np.arange(len(sizes), dtype=np.int32)
    num_samples = int(rng.randint(1, 150))
    for r, o in zip(reference_indices(sizes, documents, seq_length, num_samples, seed)[:3],
                    build_indices(sizes, documents, seq_length, num_samples, seed)):
        np.testing.assert_array_equal(o, r)


@pytest.mark.parametrize("seed,num_samples,seq_length", [(1, 5, 8), (2, 60, 8), (3, 200, 16), (4, 33, 5)])
def test_samples_are_windows_of_the_shuffled_document_stream(tmp_path, seed, num_samples, seq_length):
    rng = np.random.RandomState(seed)
    docs = random_docs(rng, 25)
    prefix = write_dataset(str(tmp_path / "corpus"), docs)
    documents = np.arange(3, 25, dtype=np.int32)
    ds = GPTDataset(MMapIndexedDataset(prefix), prefix, documents, num_samples, seq_length, seed)
    assert len(ds) >= num_samples
    doc_index, _, shuffle_index, _ = reference_indices(
        np.array([len(d) for d in docs], np.int32), documents, seq_length, num_samples, seed)
    # Obvious construction: concatenate documents in document_index order, cut overlapping windows.
    stream = np.concatenate([docs[d] for d in doc_index]).astype(np.int64)
    for i in range(len(ds)):
        s = int(shuffle_index[i])
        text = ds[i]["text"]
        assert text.dtype == np.int64 and text.shape == (seq_length + 1,)
        np.testing.assert_array_equal(text, stream[s * seq_length: s * seq_length + seq_length + 1])


def test_bad_arguments(tmp_path):
    prefix = write_dataset(str(tmp_path / "c"), [np.arange(5)])
    ds = MMapIndexedDataset(prefix)
    with pytest.raises(ValueError, match="seq-length"):
        GPTDataset(ds, prefix, np.arange(1), 3, 0, 1)
    with pytest.raises(ValueError, match="at least 1 sample"):
        GPTDataset(ds, prefix, np.arange(1), 0, 4, 1)
    with pytest.raises(IndexError):
        GPTDataset(ds, prefix, np.arange(1), 1, 4, 1)[1]


# ---------------------------------------------------------------- cache
def test_cache_reused_and_keyed_by_every_parameter(tmp_path):
    rng = np.random.RandomState(0)
    prefix = write_dataset(str(tmp_path / "c"), random_docs(rng, 20))
    cache = str(tmp_path / "cache")
    ds = MMapIndexedDataset(prefix)
    docs = np.arange(20, dtype=np.int32)
    first = GPTDataset(ds, prefix, docs, 40, 8, 1, cache_dir=cache)
    assert first.built_anew and len([f for f in os.listdir(cache) if f.endswith(".npy")]) == 3
    again = GPTDataset(ds, prefix, docs, 40, 8, 1, cache_dir=cache)
    assert not again.built_anew
    assert isinstance(again.shuffle_index, np.memmap)
    for a, b in zip((first.document_index, first.sample_index, first.shuffle_index),
                    (again.document_index, again.sample_index, again.shuffle_index)):
        np.testing.assert_array_equal(a, b)
    assert not [f for f in os.listdir(cache) if f.endswith(".tmp")]
    # Any parameter change -> another key -> built anew (never the stale set).
    variants = [dict(num_samples=41), dict(seq_length=9), dict(seed=2), dict(documents=docs[1:]),
                dict(index_split="valid")]
    for change in variants:
        kw = dict(documents=docs, num_samples=40, seq_length=8, seed=1, index_split="train")
        kw.update(change)
        d = GPTDataset(ds, prefix, kw["documents"], kw["num_samples"], kw["seq_length"], kw["seed"],
                       index_split=kw["index_split"], cache_dir=cache)
        assert d.built_anew, change
        ref = build_indices(ds.sizes, kw["documents"], kw["seq_length"], kw["num_samples"], kw["seed"])
        np.testing.assert_array_equal(d.shuffle_index, ref[2])


def test_cache_stale_when_data_changes_and_damaged_cache_rebuilt(tmp_path):
    rng = np.random.RandomState(0)
    prefix = str(tmp_path / "c")
    write_dataset(prefix, random_docs(rng, 20))
    cache = str(tmp_path / "cache")
    docs = np.arange(20, dtype=np.int32)
    GPTDataset(MMapIndexedDataset(prefix), prefix, docs, 40, 8, 1, cache_dir=cache)
    # The corpus is re-preprocessed under the same prefix with other document lengths.
    write_dataset(prefix, random_docs(rng, 20))
    ds = MMapIndexedDataset(prefix)
    d = GPTDataset(ds, prefix, docs, 40, 8, 1, cache_dir=cache)
    assert d.built_anew
    # A truncated array (e.g. a foreign tool) is detected by its shape and rebuilt.
    np.save(d.cache.path("sample_index.npy"), np.zeros((3, 2), np.int32))
    d2 = GPTDataset(ds, prefix, docs, 40, 8, 1, cache_dir=cache)
    assert d2.built_anew
    np.testing.assert_array_equal(d2.sample_index, d.sample_index)
    # A description of other content under the expected name is not trusted either.
    with open(d.cache.path("description.txt"), "w") as f:
        f.write("{}")
    assert GPTDataset(ds, prefix, docs, 40, 8, 1, cache_dir=cache).built_anew


def test_incomplete_cache_set_is_not_used(tmp_path):
    """A set whose description (written last) is missing, as during another job's write, is rebuilt."""
    prefix = write_dataset(str(tmp_path / "c"), random_docs(np.random.RandomState(0), 20))
    ds, docs, cache = MMapIndexedDataset(prefix), np.arange(20, dtype=np.int32), str(tmp_path / "cache")
    first = GPTDataset(ds, prefix, docs, 40, 8, 1, cache_dir=cache)
    os.remove(first.cache.path("description.txt"))
    np.save(first.cache.path("shuffle_index.npy"), np.zeros(5, np.uint32))  # half-written by someone
    d = GPTDataset(ds, prefix, docs, 40, 8, 1, cache_dir=cache)
    assert d.built_anew
    np.testing.assert_array_equal(d.shuffle_index, first.shuffle_index)
    assert not GPTDataset(ds, prefix, docs, 40, 8, 1, cache_dir=cache).built_anew


def test_megatron_lm_reference_files(shared_data):
    """Samples over the .bin/.idx written by Megatron-LM's own preprocessor."""
    prefix = os.path.join(shared_data, "megatron-lm-reference", "sample_text_document")
    ds = MMapIndexedDataset(prefix)
    documents = np.arange(len(ds), dtype=np.int32)
    gpt = GPTDataset(ds, prefix, documents, 300, 64, 1234)
    doc_index, _, shuffle_index, _ = reference_indices(np.asarray(ds.sizes), documents, 64, 300, 1234)
    stream = np.concatenate([ds[int(d)] for d in doc_index]).astype(np.int64)
    for i in range(0, len(gpt), 7):
        s = int(shuffle_index[i])
        np.testing.assert_array_equal(gpt[i]["text"], stream[s * 64: s * 64 + 65])


if __name__ == "__main__":
    generate_fixture()
    print("wrote", FIXTURE)
