"""Blending order against a plain port of Megatron's greedy (tests/helpers/data.py) and a golden
fixture; the per-dataset sizes with Megatron's margin. The builder: test_dataset_builder.py."""
import os

import numpy as np
import pytest

from megatron.data.blended_dataset import build_blending_indices, get_size_per_dataset, normalize
from tests.helpers.data import reference_blending
from tests.helpers.paths import FIXTURES

FIXTURE = os.path.join(FIXTURES, "blending_indices.npz")


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


if __name__ == "__main__":
    generate_fixture()
    print("wrote", FIXTURE)
