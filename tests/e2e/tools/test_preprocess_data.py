"""tools/preprocess_data.py: byte-identical to Megatron-LM's output, worker-count independence,
input forms, every bad-input error, atomic output and start-up without torch."""
import gzip
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from tools.preprocess_data import main, run, get_args

from tests.helpers.paths import ROOT
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def _files(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def _jsonl(path, rows, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def _run(*argv):
    return run(get_args([str(a) for a in argv]))


def _random_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"text": " ".join(map(str, rng.integers(0, 1000, rng.integers(0, 40)))), "id": i} for i in range(n)]


@pytest.mark.parametrize("workers", [1, 2])
def test_reference_vector_byte_identical(shared_data, tmp_path, workers):
    ref = os.path.join(shared_data, "megatron-lm-reference")
    _run("--input", os.path.join(ref, "sample.jsonl"), "--output-prefix", tmp_path / "out",
         "--tokenizer-type", "SentencePieceTokenizer", "--append-eod", "--workers", workers, "--chunk-size", 7,
         "--tokenizer-model", os.path.join(shared_data, "sentencepiece-llama-32k.model"))
    assert _files(str(tmp_path / "out_text_document")) == _files(os.path.join(ref, "sample_text_document"))


def test_workers_1_and_2_identical_and_ids_right(tmp_path):
    docs = _random_docs(300)
    src = _jsonl(tmp_path / "in.jsonl", docs)
    for w in (1, 2):
        stats = _run("--input", src, "--output-prefix", tmp_path / f"w{w}", *NULL, "--append-eod",
                     "--workers", w, "--chunk-size", 11)
    assert _files(str(tmp_path / "w1_text_document")) == _files(str(tmp_path / "w2_text_document"))
    ds = MMapIndexedDataset(str(tmp_path / "w2_text_document"))
    expected = [[int(x) for x in d["text"].split()] + [1000] for d in docs if d["text"]]
    assert [a.tolist() for a in ds] == expected and ds.dtype == np.uint16
    assert stats["empty"] == [len(docs) - len(expected)] and stats["documents"] == [len(expected)]


def test_multiple_keys_gz_folder_glob_and_no_eod(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", [{"text": "1 2", "title": "7"}, {"text": "3", "title": "8 9"}])
    _jsonl(folder / "b.jsonl.gz", [{"text": "4 5 6", "title": "10"}], opener=gzip.open)
    (folder / "notes.txt").write_text("ignored")
    for name, inp in (("dir", folder), ("glob", folder / "*.jsonl*")):
        _run("--input", inp, "--output-prefix", tmp_path / name, *NULL, "--json-keys", "text", "title")
        text = MMapIndexedDataset(str(tmp_path / f"{name}_text_document"))
        title = MMapIndexedDataset(str(tmp_path / f"{name}_title_document"))
        assert [a.tolist() for a in text] == [[1, 2], [3], [4, 5, 6]]
        assert [a.tolist() for a in title] == [[7], [8, 9], [10]]


def test_int32_for_large_vocabulary(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [{"text": "65999 1"}])
    _run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "70000", "--append-eod")
    ds = MMapIndexedDataset(str(tmp_path / "o_text_document"))
    assert ds.dtype == np.int32 and ds[0].tolist() == [65999, 1, 70000]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("bad_line, message", [
    ('{"text": "1 2"', "malformed JSON"),
    ('{"body": "1 2"}', "no key 'text'"),
    ('{"text": 5}', "is a int"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_line_names_file_and_line_and_leaves_nothing(tmp_path, capsys, workers, bad_line, message):
    rows = [{"text": "1"}] * 30 + [bad_line] + [{"text": "2"}] * 5
    src = _jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["--input", src, "--output-prefix", str(out / "o"), *NULL, "--workers", str(workers),
                 "--chunk-size", "4"]) == 1
    err = capsys.readouterr().err
    assert f"{src}:31: " in err and message in err
    assert os.listdir(out) == []  # no final and no temporary files
    stats = _run("--input", src, "--output-prefix", out / "o", *NULL, "--workers", workers, "--skip-invalid")
    assert stats["invalid"] == 1 and stats["documents"] == [35]
    assert "Skipped 1 invalid lines" in capsys.readouterr().out


def test_invalid_utf8_replaced_and_counted_blank_lines_ignored(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "1 2"}\n\n{"text": "3 \xff"}\n{"text": "4"}\n')
    src = str(path)
    stats = _run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type", "GPT2BPETokenizer",
                 "--vocab-file", _gpt2_files(tmp_path)[0], "--merge-file", _gpt2_files(tmp_path)[1])
    assert stats["bad_utf8"] == 1 and stats["documents"] == [3]
    assert "Replaced invalid UTF-8 in 1 lines" in capsys.readouterr().out


def _gpt2_files(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    if not vocab.exists():
        t = ByteLevelBPETokenizer()
        t.train_from_iterator(["1 2 3 4"], vocab_size=260, special_tokens=["<|endoftext|>"], show_progress=False)
        t.save_model(str(tmp_path))
    return str(vocab), str(merges)


def test_missing_input_is_an_error(tmp_path, capsys):
    assert main(["--input", str(tmp_path / "nope*.jsonl"), "--output-prefix", str(tmp_path / "o"), *NULL]) == 1
    assert "--input" in capsys.readouterr().err


def test_cli_starts_fast_without_torch(shared_data, tmp_path):
    """The tool as users run it: imports stay light (no torch) and it starts well under 2 s."""
    code = ("import sys, time; t = time.perf_counter(); sys.argv[0] = 'tools/preprocess_data.py'; "
            "import runpy; mod = runpy.run_path('tools/preprocess_data.py', run_name='preprocess'); "
            "print(time.perf_counter() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    seconds, torch_loaded = out.stdout.split()
    assert torch_loaded == "False" and float(seconds) < 2.0
    ref = os.path.join(shared_data, "megatron-lm-reference")
    start = time.perf_counter()
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", os.path.join(ref, "sample.jsonl"),
                    "--output-prefix", str(tmp_path / "cli"), "--tokenizer-type", "Llama2Tokenizer",
                    "--tokenizer-model", os.path.join(shared_data, "sentencepiece-llama-32k.model"),
                    "--append-eod", "--workers", "2"], cwd=ROOT, check=True, capture_output=True)
    assert time.perf_counter() - start < 10
    assert _files(str(tmp_path / "cli_text_document")) == _files(os.path.join(ref, "sample_text_document"))


def test_fast_json_path_falls_back_for_unusual_lines(tmp_path, capsys):
    """Lines the one-call-per-chunk parser does not take (whitespace, CRLF, blank lines) still parse
    like json.loads; a string split over two lines is an error naming the first of them."""
    rows = [{"text": "1 2"}, ' {"text": "3"} ', '{"text": "4 5"}\r', "", '{"text": "6", "x": [1, {"y": 2}]}']
    src = _jsonl(tmp_path / "odd.jsonl", rows)
    _run("--input", src, "--output-prefix", tmp_path / "odd", *NULL, "--chunk-size", 3)
    assert [a.tolist() for a in MMapIndexedDataset(str(tmp_path / "odd_text_document"))] == [[1, 2], [3], [4, 5], [6]]
    split = _jsonl(tmp_path / "split.jsonl", ['{"text": "1"}', '{"text": "2', '3"}', '{"text": "4"}'])
    assert main(["--input", split, "--output-prefix", str(tmp_path / "s"), *NULL]) == 1
    assert f"{split}:2: malformed JSON" in capsys.readouterr().err


def test_tokenize_batch_flat_equals_tokenize(shared_data):
    from megatron.tokenizer.null_tokenizer import NullTokenizer
    from megatron.tokenizer.sp_tokenizer import SentencePieceTokenizer

    sp = SentencePieceTokenizer(os.path.join(shared_data, "sentencepiece-llama-32k.model"))
    texts = ["To be, or not to be", "", "héllo ☃ 日本語", " ", "a\nb\tc  d"]

    class PublicOnly:  # a sentencepiece without the raw batch call takes the public path
        def __init__(self, inner):
            self.encode_as_numpy = inner.encode_as_numpy

    for tok in (sp, NullTokenizer(1000)):
        cases = texts if tok is sp else ["1 2 3", "", "999"]
        flat, lengths = tok.tokenize_batch_flat(cases, dtype=np.uint16)
        expected = [tok.tokenize(t) for t in cases]
        assert flat.dtype == np.uint16 and lengths.tolist() == [len(e) for e in expected]
        assert flat.tolist() == [i for e in expected for i in e]
    fast = sp.tokenize_batch_flat(texts)
    sp._sp = PublicOnly(sp._sp)
    public = sp.tokenize_batch_flat(texts)
    assert all(np.array_equal(a, b) for a, b in zip(fast, public))
    assert sp.tokenize_batch_flat([])[0].size == 0
