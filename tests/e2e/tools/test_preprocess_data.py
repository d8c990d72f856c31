"""tools/preprocess_data.py: byte-identical to Megatron-LM's output (empty documents included),
worker-count independence, input forms, every bad-input error, atomic output, clean-up after a
kill, long texts in pieces and start-up without torch."""
import glob
import gzip
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset
from tools.preprocess_data import _pieces, get_args, main, run, splits_at_spaces

from tests.helpers.paths import ROOT
from tests.helpers.reliability import child_processes, process_running
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
    # Every document has its entry, the empty ones without a sequence (Megatron-LM's layout).
    empty = [not d["text"] for d in docs]
    assert ds.document_indices.tolist() == [0] + np.cumsum(np.logical_not(empty)).tolist()
    assert stats["empty"] == [sum(empty)] > [0] and stats["documents"] == [len(docs)]


# Written by Megatron-LM's own tools/preprocess_data.py (commit d98e8a64, the one of
# ../shared/data/megatron-lm-reference) from EMPTY_DOCS with the shared SentencePiece model,
# --json-keys text --tokenizer-type SentencePieceTokenizer --workers 1, with and without
# --append-eod. (To run it without its training package, only its tokenizer-argument parser was
# replaced; Encoder.encode and IndexedDatasetBuilder ran unchanged.) Its code path: an empty text
# gives doc_ids = [] and sentence_lens = [], no EOD (appended only to non-empty documents), and
# add_document([], []) adds a document-index entry equal to the previous one and no sequence;
# " " tokenizes to [259], a document like any other.
EMPTY_DOCS = [{"text": "To be or not"}, {"text": ""}, {"text": "that is"}, {"text": ""}, {"text": " "},
              {"text": "the question"}]
MEGATRON_EMPTY = {  # --append-eod: (.idx, .bin) as hex
    True: ("4d4d49444944580000010000000000000008040000000000000007000000000000000500000003000000020000"
           "000300000000000000000000000a00000000000000100000000000000014000000000000000000000000000000"
           "010000000000000001000000000000000200000000000000020000000000000003000000000000000400000000"
           "000000", "ff065b01ba01cb01020071015d010200030102001001b40b0200"),
    False: ("4d4d49444944580000010000000000000008040000000000000007000000000000000400000002000000010000"
            "0002000000000000000000000008000000000000000c000000000000000e000000000000000000000000000000"
            "010000000000000001000000000000000200000000000000020000000000000003000000000000000400000000"
            "000000", "ff065b01ba01cb0171015d0103011001b40b"),
}


@pytest.mark.parametrize("eod", [True, False])
@pytest.mark.parametrize("workers", [1, 2])
def test_empty_documents_byte_identical_to_megatron_lm(shared_data, tmp_path, capsys, eod, workers):
    src = _jsonl(tmp_path / "empty.jsonl", EMPTY_DOCS)
    stats = _run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type", "SentencePieceTokenizer",
                 "--tokenizer-model", os.path.join(shared_data, "sentencepiece-llama-32k.model"),
                 "--workers", workers, "--chunk-size", 2, *(["--append-eod"] if eod else []))
    idx, bin_ = MEGATRON_EMPTY[eod]
    assert _files(str(tmp_path / "o_text_document")) == (bytes.fromhex(bin_), bytes.fromhex(idx))
    assert stats["documents"] == [6] and stats["empty"] == [2]
    assert "6 documents" in capsys.readouterr().out
    ds = MMapIndexedDataset(str(tmp_path / "o_text_document"))
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 2, 3, 4] and len(ds) == 4


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
    # issue 31: reached the tokenizer ("TypeError: List elements must be str or bytes")
    ('{"text": "1 \\ud800 2"}', "'text' holds a lone surrogate ('\\ud800' at character 2"),
    # the fourth hostile pass: a RecursionError traceback
    ('{"text": ' + "[" * 100000, "JSON nested too deeply"),
])
def test_bad_line_names_file_and_line_and_leaves_nothing(tmp_path, capsys, workers, bad_line, message):
    rows = [{"text": "1"}] * 30 + [bad_line] + [{"text": "2"}] * 5
    src = _jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["--input", src, "--output-prefix", str(out / "o"), *NULL, "--workers", str(workers),
                 "--chunk-size", "4"]) == 2
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


def test_duplicate_json_keys_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        get_args(["--input", "x.jsonl", "--output-prefix", str(tmp_path / "o"), *NULL,
                  "--json-keys", "text", "title", "text"])
    assert exit_.value.code == 2
    assert "--json-keys (text title text): text given more than once" in capsys.readouterr().err


def test_missing_input_is_an_error(tmp_path, capsys):
    assert main(["--input", str(tmp_path / "nope*.jsonl"), "--output-prefix", str(tmp_path / "o"), *NULL]) == 2
    assert "--input" in capsys.readouterr().err


def test_cli_starts_fast_without_torch(shared_data, tmp_path):
    """The tool as users run it: imports stay light (no torch, transformers or sympy: what made its
    start slow). Asserted on the imports, not on a time, which a loaded machine stretches (2 s
    became 6.9 s under a load of 200)."""
    code = ("import sys; sys.argv[0] = 'tools/preprocess_data.py'; "
            "import runpy; mod = runpy.run_path('tools/preprocess_data.py', run_name='preprocess'); "
            "print(*[m in sys.modules for m in ('torch', 'transformers', 'sympy')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"], out.stdout
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
    assert main(["--input", split, "--output-prefix", str(tmp_path / "s"), *NULL]) == 2
    assert f"{split}:2: malformed JSON" in capsys.readouterr().err


@pytest.mark.parametrize("chunk_size", [1, 5])
def test_last_line_without_newline(tmp_path, chunk_size):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "1 2"}\n{"text": "3"}')  # one chunk "a\nb", or two
    _run("--input", path, "--output-prefix", tmp_path / "o", *NULL, "--chunk-size", chunk_size)
    assert [a.tolist() for a in MMapIndexedDataset(str(tmp_path / "o_text_document"))] == [[1, 2], [3]]


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


# ---------------------------------------------------------------- interrupted runs
_KILLED_RUN = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import tools.preprocess_data as pp
from megatron.data import indexed_dataset as ix
point, n, sig = sys.argv[2], int(sys.argv[3]), getattr(signal, sys.argv[4])
calls = [0]
def trap(orig):
    def call(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), sig)
        return orig(*a, **k)
    return call
if point == "write":
    ix.MMapIndexedDatasetBuilder.add_documents = trap(ix.MMapIndexedDatasetBuilder.add_documents)
else:
    setattr(os, point, trap(getattr(os, point)))
sys.exit(pp.main(sys.argv[5:]))
"""

# (where the kill lands, at which call, workers). Two keys: os.remove 1/2 delete the older
# .idx of text/title; os.replace 1..4 rename text .bin, text .idx, title .bin, title .idx.
KILL_POINTS = [("write", 2, 1), ("write", 3, 2), ("remove", 1, 1), ("remove", 2, 1),
               ("replace", 1, 1), ("replace", 2, 1), ("replace", 3, 1), ("replace", 4, 1)]


def _outputs(folder, name):
    return {key: _files(os.path.join(folder, f"{name}_{key}_document")) for key in ("text", "title")}


@pytest.fixture(scope="module")
def old_and_new(tmp_path_factory):
    """A complete older output and the complete output of the new input, for comparison."""
    root = tmp_path_factory.mktemp("interrupted")
    new = _jsonl(root / "new.jsonl", [{"text": f"{i} {i + 1}", "title": str(i % 7)} for i in range(300)])
    old = _jsonl(root / "old.jsonl", [{"text": "5 5 5", "title": "9"}] * 40)
    for name, src in (("old", old), ("new", new)):
        _run("--input", src, "--output-prefix", root / name, *NULL, "--json-keys", "text", "title")
    return root, new, _outputs(root, "old"), _outputs(root, "new")


@pytest.mark.parametrize("point, n, workers", KILL_POINTS)
def test_kill_at_any_point_leaves_no_partial_output_and_next_run_cleans_up(old_and_new, tmp_path, point, n, workers):
    root, new, old_files, new_files = old_and_new
    for key, (bin_, idx) in old_files.items():  # an older run's complete output under the same names
        (tmp_path / f"o_{key}_document.bin").write_bytes(bin_)
        (tmp_path / f"o_{key}_document.idx").write_bytes(idx)
    argv = ["--input", new, "--output-prefix", str(tmp_path / "o"), *NULL, "--json-keys", "text", "title",
            "--chunk-size", "16", "--workers", str(workers)]
    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN, ROOT, point, str(n), "SIGKILL", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    for key in ("text", "title"):
        prefix = str(tmp_path / f"o_{key}_document")
        try:
            MMapIndexedDataset(prefix)
        except IndexedDatasetError:
            continue  # not loadable: nothing that looks like a dataset
        # Loadable only as one run's complete pair, never an old file paired with a new one.
        assert _files(prefix) in (old_files[key], new_files[key]), (key, os.listdir(tmp_path))
    assert glob.glob(str(tmp_path / "*.tmp-*")), "a SIGKILL leaves its temporaries behind"
    assert main(argv) == 0
    assert sorted(os.listdir(tmp_path)) == sorted(f"o_{k}_document.{e}" for k in ("text", "title")
                                                  for e in ("bin", "idx"))
    assert _outputs(tmp_path, "o") == new_files


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_sigterm_or_ctrl_c_removes_temporaries_at_once_and_keeps_the_older_output(old_and_new, tmp_path,
                                                                                  sig):
    """SIGTERM (Slurm, kill), SIGINT (Ctrl-C) or SIGHUP (the terminal closed; the fourth hostile
    pass: no line and a ``.bin.tmp`` left) during the writes: one line naming the signal, no
    traceback, the shell's status for that signal, no temporary, the older output untouched."""
    root, new, old_files, _ = old_and_new
    for key, (bin_, idx) in old_files.items():
        (tmp_path / f"o_{key}_document.bin").write_bytes(bin_)
        (tmp_path / f"o_{key}_document.idx").write_bytes(idx)
    argv = ["--input", new, "--output-prefix", str(tmp_path / "o"), *NULL, "--json-keys", "text", "title",
            "--chunk-size", "16", "--workers", "2"]
    from tests.helpers.reliability import ctrl_c_default

    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN, ROOT, "write", "3", sig, *argv],
                          capture_output=True, text=True, timeout=120, preexec_fn=ctrl_c_default)
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"preprocess_data.py: stopped by {sig}: no partial output is left (earlier outputs under "
        "the same names are as they were); run it again to write the output"], proc.stderr
    assert not glob.glob(str(tmp_path / "*.tmp-*"))
    assert _outputs(tmp_path, "o") == old_files


def test_a_second_run_on_the_same_outputs_is_refused_while_the_first_runs(tmp_path, capsys):
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    src = _jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}])
    first = MMapIndexedDatasetBuilder(str(tmp_path / "o_text_document.bin"), np.uint16)  # a live writer
    try:
        assert main(["--input", src, "--output-prefix", str(tmp_path / "o"), *NULL]) == 2
        assert "another process is writing" in capsys.readouterr().err
    finally:
        first.abort()


# ---------------------------------------------------------------- long texts in pieces
def test_long_texts_in_pieces_give_the_same_ids(shared_data):
    """SentencePiece ids of a text cut at the preprocessor's points equal those of one call:
    Shakespeare, and random strings full of the characters that could break it (runs of spaces,
    U+2581, tabs, newlines, accents, CJK, emoji, digits)."""
    from megatron.tokenizer.sp_tokenizer import SentencePieceTokenizer

    sp = SentencePieceTokenizer(os.path.join(shared_data, "sentencepiece-llama-32k.model"))
    assert splits_at_spaces(sp)
    encode = sp._sp.encode
    with open(os.path.join(shared_data, "megatron-lm-reference", "sample.jsonl")) as f:
        corpus = "\n".join(json.loads(line)["text"] for line in f)
    for limit in (7, 50, 4096):
        pieces = list(_pieces(corpus, limit))
        assert len(pieces) > 1 and " ".join(pieces) == corpus
        assert [i for p in pieces for i in encode(p)] == encode(corpus)
    rng = random.Random(0)
    alphabet = list("ab  \u2581\n\t.é日😀1")
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        for limit in (1, 3, 8):
            assert [i for p in _pieces(text, limit) for i in encode(p)] == encode(text), (text, limit)


def test_pieces_only_where_the_model_allows(shared_data, tmp_path):
    from sentencepiece import sentencepiece_model_pb2

    from megatron.tokenizer.null_tokenizer import NullTokenizer
    from megatron.tokenizer.sp_tokenizer import SentencePieceTokenizer

    assert not splits_at_spaces(NullTokenizer(10))
    source = os.path.join(shared_data, "sentencepiece-llama-32k.model")
    for change in ("no dummy prefix", "unigram", "piece with inner space"):
        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(open(source, "rb").read())
        if change == "no dummy prefix":
            model.normalizer_spec.add_dummy_prefix = False
        elif change == "unigram":
            model.trainer_spec.model_type = model.trainer_spec.UNIGRAM
        else:
            model.pieces[300].piece = "a\u2581b"
        path = tmp_path / f"{change}.model"
        path.write_bytes(model.SerializeToString())
        assert not splits_at_spaces(SentencePieceTokenizer(str(path))), change


# ---------------------------------------------------------------- a worker or the parent killed
_SLOW_OR_DYING_WORKER = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import megatron.data.worker_pool as worker_pool
import tools.preprocess_data as pp
mode, at = sys.argv[2], int(sys.argv[3])
worker_pool.STOPPED_LIMIT_S = 3.0
real = pp.encode_chunk
def encode(path, first_line, chunk):  # runs in a forked worker, which inherits this module
    if first_line >= at:
        if mode == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    return real(path, first_line, chunk)
pp.encode_chunk = encode
sys.exit(pp.main(sys.argv[4:]))
"""


def _start_with_faulty_worker(src, out, mode):
    """preprocess_data.py --workers 2 whose worker dies ("die"), stops itself ("stop": SIGSTOP) or
    sleeps ("sleep") at the chunk of line 100."""
    argv = ["--input", src, "--output-prefix", str(out / "o"), *NULL, "--chunk-size", "16",
            "--workers", "2"]
    return subprocess.Popen([sys.executable, "-c", _SLOW_OR_DYING_WORKER, ROOT, mode, "100", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("mode, what", [
    ("die", r"was killed by SIGKILL .*no output written.*--workers.*"),
    ("stop", r"has been stopped \(SIGSTOP or a debugger\) for \d+ s .*no output written.*")])
def test_a_worker_killed_or_stopped_stops_the_run_in_one_line_with_no_output_and_no_orphan(
        old_and_new, tmp_path, mode, what):
    """Before: multiprocessing.Pool replaced a dead worker and waited for its chunk forever, and a
    SIGSTOPped worker held its chunk while the run waited forever."""
    proc = _start_with_faulty_worker(old_and_new[1], tmp_path, mode)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"preprocess_data.py hung on a worker ({mode})")
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"preprocess_data.py: error: tokenizer worker \(pid \d+\) " + what, lines[0]), err
    assert os.listdir(tmp_path) == []  # neither a .bin/.idx pair nor a temporary
    assert not _processes_naming(str(tmp_path)), "a tokenizer worker outlived the run"


def _processes_naming(text):
    """Live processes whose command line holds ``text`` (forked workers keep their parent's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read() and process_running(int(pid)):
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_workers_die_with_a_sigkilled_parent(old_and_new, tmp_path):
    proc = _start_with_faulty_worker(old_and_new[1], tmp_path, "sleep")
    deadline = time.time() + 60
    while len(child_processes(proc.pid)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    workers = child_processes(proc.pid)
    assert len(workers) >= 2
    time.sleep(1)  # the workers are in their sleeping chunk
    proc.kill()
    proc.wait()
    deadline = time.time() + 5
    while any(map(process_running, workers)) and time.time() < deadline:
        time.sleep(0.05)
    alive = [w for w in workers if process_running(w)]
    for w in alive:
        os.kill(w, signal.SIGKILL)
    assert not alive, "tokenizer workers outlived their SIGKILLed parent"
    assert not glob.glob(str(tmp_path / "*.idx"))  # nothing that looks like a dataset
