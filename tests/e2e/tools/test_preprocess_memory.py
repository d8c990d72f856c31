"""Preprocessing memory is bounded by the chunks in flight, not by the corpus size (issue: data
pipeline, "Memory"). Each run is a fresh process; its peak resident memory (the main process and,
separately, the largest worker) is compared for a corpus and one eight times larger.

The main process's peak is its own VmHWM (/proc/self/status), which starts afresh at exec:
ru_maxrss would start at the RSS of the test process that forked it (Linux keeps the high-water
mark across exec), so it moved with the test's own memory, not the child's. The workers' peak is
ru_maxrss of the children, forked from the main process early and alike in every run."""
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
    "import os; status = '/proc/self/status'; "
    "hwm = [int(l.split()[1]) for l in open(status) if l.startswith('VmHWM:')] if os.path.exists(status) else []; "
    "print(hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
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


def _sp_peak_kib(src, prefix, workers, model):
    # glibc's default raises its mmap threshold after each large free, so freed blocks of up to
    # 32 MiB stay in the heap and RSS shows them too (main process, 10 MB lines: 98 MB instead
    # of 70 MB, the same for 3 or 6 lines); a fixed threshold measures what the code holds.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, "--input", src, "--output-prefix", prefix, "--tokenizer-type",
         "Llama2Tokenizer", "--tokenizer-model", model, "--append-eod", "--workers", str(workers)],
        capture_output=True, text=True, check=True, env=env)
    return tuple(map(int, out.stdout.split()[-2:]))


def _huge_lines(path, shared_data, mb, lines):
    """``lines`` JSON lines of about ``mb`` MB each: Shakespeare paragraphs joined into one text."""
    with open(os.path.join(shared_data, "megatron-lm-reference", "sample.jsonl")) as f:
        body = "\n".join(json.loads(line)["text"] for line in f)
    text = "\n".join([body] * (int(mb * 1e6) // len(body) + 1))
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(lines):
            f.write(json.dumps({"text": text}) + "\n")
    return os.path.getsize(path) // lines


@pytest.mark.parametrize("workers, sizes_mb, lines", [
    (1, (1, 4), 1),
    pytest.param(2, (2, 6), 3, marks=pytest.mark.slow),
])
def test_one_huge_document_is_held_a_bounded_number_of_times(tmp_path, shared_data, workers, sizes_mb, lines):
    """Huge JSON lines: peak memory grows by at most ~3 bytes per byte of the line (its text, its
    tokens and their copies), in the main process and in a worker, however many such lines the
    window would let in flight. Measured as the slope between two line sizes, so start-up
    transients (the tokenizer model) cancel, with a fixed glibc mmap threshold (see above). One SentencePiece call on a whole text needs ~45
    bytes per byte (measured: 2.35 GB for one 51 MB line before texts were tokenized in pieces,
    0.16 GB after); and with 4 x workers chunks in flight the main process used to hold every
    huge line of the window at once."""
    model = os.path.join(shared_data, "sentencepiece-llama-32k.model")
    peaks, line_bytes = [], []
    for mb in sizes_mb:
        src = str(tmp_path / f"huge{mb}.jsonl")
        line_bytes.append(_huge_lines(src, shared_data, mb, lines))
        peaks.append(_sp_peak_kib(src, str(tmp_path / f"h{mb}"), workers, model))
    grown = line_bytes[1] - line_bytes[0]
    for which, name in ((0, "the main process"), (1, "a worker"))[:workers]:
        per_byte = (peaks[1][which] - peaks[0][which]) * 1024 / grown
        assert per_byte < 4, f"{name}: peak grows by {per_byte:.1f} bytes per byte of the line"
