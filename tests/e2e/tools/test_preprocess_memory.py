"""Preprocessing memory is bounded by the chunks in flight, not by the corpus size (issue: data
pipeline, "Memory"). Each run is a fresh process; its peak resident memory (ru_maxrss: the main
process and, separately, the largest worker) is compared for a corpus and one eight times larger."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.paths import ROOT

_PEAK = (
    "import resource, sys; sys.path.insert(0, %r); from tools.preprocess_data import main; "
    "main(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
    "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)" % ROOT)


def _corpus(path, n_docs, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"text": " ".join(map(str, rng.integers(0, 1000, 200)))}) + "\n")
    return os.path.getsize(path)


def _peak_kib(src, prefix, workers):
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, "--input", src, "--output-prefix", prefix, "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "1000", "--append-eod", "--workers", str(workers)],
        capture_output=True, text=True, check=True)
    main_kib, child_kib = map(int, out.stdout.split()[-2:])
    return main_kib, child_kib


@pytest.mark.parametrize("workers", [1, 2])
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path, workers):
    small = _corpus(tmp_path / "small.jsonl", 5_000)       # ~4 MB of JSON lines
    large = _corpus(tmp_path / "large.jsonl", 40_000)      # ~32 MB
    assert large > 7 * small
    main_s, child_s = _peak_kib(str(tmp_path / "small.jsonl"), str(tmp_path / "s"), workers)
    main_l, child_l = _peak_kib(str(tmp_path / "large.jsonl"), str(tmp_path / "l"), workers)
    grown_mib = (main_l - main_s) / 1024
    # The corpus grows by ~28 MB; memory held for it would show as at least that much.
    assert grown_mib < 8, f"main process peak grew by {grown_mib:.1f} MiB for a corpus {large / small:.0f}x larger"
    if workers > 1:
        assert (child_l - child_s) / 1024 < 8
