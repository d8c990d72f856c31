"""SFTDataset: packing, per-document positions / cu_seqlens, masks, truncation, determinism.

Oracle: the conversations themselves (written here with the indexed-dataset builder): every
sample's segments are re-derived from its document ids and compared token for token.
"""

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDatasetBuilder
from megatron.data.sft_dataset import SFTDataset, pack_first_fit, packing_efficiency


def _write(prefix, docs, masks):
    for name, arrays, dtype in ((f"{prefix}_text_document", docs, np.uint16),
                                (f"{prefix}_text_loss_mask_document", masks, np.uint8)):
        with MMapIndexedDatasetBuilder(name + ".bin", dtype) as b:
            for a in arrays:
                b.add_document(a, [len(a)])
            b.finalize(name + ".idx")
    return f"{prefix}_text_document"


def _corpus(tmp_path, n=40, seed=0, max_len=30):
    rng = np.random.RandomState(seed)
    docs = [rng.randint(1, 1000, size=rng.randint(2, max_len)) for _ in range(n)]
    masks = [(rng.rand(len(d)) < 0.5).astype(np.uint8) for d in docs]
    return _write(str(tmp_path / "c"), docs, masks), docs, masks


def _segments(sample):
    cu = sample["cu_seqlens"]
    cu = cu[cu >= 0]
    return [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]


@pytest.mark.parametrize("packed", [True, False])
def test_every_document_once_per_epoch_and_segments_exact(tmp_path, packed):
    prefix, docs, masks = _corpus(tmp_path)
    s = 32
    ds = SFTDataset(prefix, s, seed=7, packed=packed, packing_window=8)
    seen = []
    for i in range(len(ds)):
        sample = ds[i]
        assert all(sample[k].shape == (s,) for k in ("tokens", "labels", "loss_mask", "position_ids",
                                                     "document_ids"))
        assert sample["cu_seqlens"].shape == (s + 1,) and sample["cu_seqlens"].dtype == np.int32
        segs = _segments(sample)
        assert segs[0][0] == 0 and segs[-1][1] == s
        assert sample["max_seqlen"] == max(b - a for a, b in segs)
        docs_here = ds._locate(i)
        assert len(segs) in (len(docs_here), len(docs_here) + 1)
        for k, (a, b) in enumerate(segs):
            assert (sample["position_ids"][a:b] == np.arange(b - a)).all()
            assert (sample["document_ids"][a:b] == k).all()
            if k < len(docs_here):
                d = int(ds.documents[docs_here[k]])
                seen.append(d)
                assert b - a == len(docs[d]) - 1
                assert (sample["tokens"][a:b] == docs[d][:-1]).all()
                assert (sample["labels"][a:b] == docs[d][1:]).all()
                assert (sample["loss_mask"][a:b] == masks[d][1:]).all()
            else:  # padding
                assert (sample["loss_mask"][a:b] == 0).all()
    assert sorted(seen) == list(range(len(docs)))
    if not packed:
        assert len(ds) == len(docs)


def test_deterministic_per_seed_and_index(tmp_path):
    prefix, _, _ = _corpus(tmp_path)
    a, b = SFTDataset(prefix, 32, seed=3, num_samples=50), SFTDataset(prefix, 32, seed=3, num_samples=50)
    # Read b backwards: sample i does not depend on what was read before (exact resume).
    got_b = {i: b[i] for i in reversed(range(50))}
    for i in range(50):
        for k, v in a[i].items():
            assert (v == got_b[i][k]).all()
    c = SFTDataset(prefix, 32, seed=4, num_samples=50)
    assert any((a[i]["tokens"] != c[i]["tokens"]).any() for i in range(5))
    with pytest.raises(IndexError):
        a[50]


def test_long_conversations_truncated_or_skipped(tmp_path):
    # The last one's assistant tokens all lie beyond what truncation keeps (labels 1..16).
    docs = [np.arange(1, 6), np.arange(1, 40), np.array([5]), np.arange(1, 30)]
    masks = [np.array([0, 0, 1, 1, 1], np.uint8), np.ones(39, np.uint8), np.ones(1, np.uint8),
             (np.arange(29) >= 17).astype(np.uint8)]
    prefix = _write(str(tmp_path / "l"), docs, masks)
    cut = SFTDataset(prefix, 16, packed=False, shuffle=False)
    assert cut.report == {"documents": 2, "truncated": 1, "skipped_long": 0, "skipped_short": 1,
                          "skipped_no_loss_after_truncation": 1, "samples_per_epoch": 2}
    assert (cut[1]["tokens"] == np.arange(1, 17)).all() and (cut[1]["labels"] == np.arange(2, 18)).all()
    skip = SFTDataset(prefix, 16, packed=False, truncate=False, shuffle=False)
    assert skip.report["skipped_long"] == 2 and len(skip) == 1
    assert skip[0]["loss_mask"].tolist() == [0, 1, 1, 1] + [0] * 12


def test_mismatched_mask_dataset_refused(tmp_path):
    prefix, docs, masks = _corpus(tmp_path, n=5)
    _write(str(tmp_path / "other"), docs[:4], masks[:4])
    with pytest.raises(IndexedDatasetError, match="same documents"):
        SFTDataset(prefix, 32, mask_prefix=str(tmp_path / "other_text_loss_mask_document"))


def test_first_fit_decreasing_closed_form():
    # FFD in one window of [5, 4, 3, 3, 2, 2, 1] into capacity 7: {5,2}, {4,3}, {3,2,1}.
    lengths = np.array([3, 5, 2, 4, 1, 3, 2])
    bins = pack_first_fit(lengths, 7, window=7)
    assert [sorted(lengths[b].tolist()) for b in bins] == [[2, 5], [3, 4], [1, 2, 3]]
    assert packing_efficiency(lengths, bins, 7) == 20 / 21
    # window 1: plain first-fit in the given order.
    ff = pack_first_fit(lengths, 7, window=1)
    assert [lengths[b].tolist() for b in ff] == [[3, 2, 1], [5, 2], [4, 3]]
    for b in bins + ff:
        assert lengths[b].sum() <= 7
    assert sorted(i for b in bins for i in b) == list(range(7))


def test_index_cache_reused_and_equal(tmp_path):
    prefix, _, _ = _corpus(tmp_path)
    cache = tmp_path / "cache"
    built = SFTDataset(prefix, 32, seed=5, num_samples=60, cache_dir=str(cache))
    files = sorted(p.name for p in cache.iterdir())
    assert any(f.endswith("sample_offsets.npy") for f in files) and any(f.endswith("description.txt") for f in files)
    loaded = SFTDataset(prefix, 32, seed=5, num_samples=60, cache_dir=str(cache))
    assert isinstance(loaded.sample_offsets, np.memmap)  # read from the cache, not rebuilt
    plain = SFTDataset(prefix, 32, seed=5, num_samples=60)
    assert len(built) == len(loaded) == len(plain) == 60
    for i in range(60):
        for k in plain[i]:
            assert (plain[i][k] == loaded[i][k]).all()
    # Another seed is another set of files, never the cached one.
    SFTDataset(prefix, 32, seed=6, num_samples=60, cache_dir=str(cache))
    assert len(list(cache.glob("*description.txt"))) == 2


def test_blend_of_two_sft_datasets(tmp_path):
    from megatron.data.blended_dataset import BlendedDataset

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa, _, _ = _corpus(tmp_path / "a", seed=1)
    pb, _, _ = _corpus(tmp_path / "b", seed=2)
    a, b = SFTDataset(pa, 32, num_samples=30), SFTDataset(pb, 32, num_samples=30)
    blend = BlendedDataset([a, b], [0.5, 0.5], 20)
    for i in range(20):
        src = (a, b)[int(blend.dataset_index[i])][int(blend.dataset_sample_index[i])]
        assert all((blend[i][k] == src[k]).all() for k in src)
    assert sorted(set(blend.dataset_index.tolist())) == [0, 1]


def test_samples_collate_into_a_batch(tmp_path):
    import torch
    from torch.utils.data import default_collate

    prefix, _, _ = _corpus(tmp_path)
    ds = SFTDataset(prefix, 32, seed=1)
    batch = default_collate([ds[0], ds[1], ds[2]])
    assert batch["tokens"].shape == (3, 32) and batch["cu_seqlens"].shape == (3, 33)
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["max_seqlen"].shape == (3,)
