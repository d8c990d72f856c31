"""Tokenize JSON lines into Megatron's mmap indexed dataset (``{prefix}_{key}_document.bin/.idx``).

Megatron-LM's ``tools/preprocess_data.py`` flags and output, byte for byte: run on the same input
with the same tokenizer and ``--append-eod`` it writes the same files (tested against a vector
written by Megatron-LM). Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --append-eod --workers 8

Parallelism: the main process reads the input as raw bytes in chunks of whole lines (at most
``--chunk-size`` documents and about 256 KiB each; a longer line is a chunk of its own) and hands
them to ``--workers`` processes, which decode, parse and tokenize a chunk with the tokenizer's
batch path and send back each key's tokens as one flat array plus the document lengths. The main
process writes the chunks in input order, so the output does not depend on ``--workers``, and it
never unpickles per document, so it keeps up with many workers even for small documents.

Memory is bounded by the chunk size, not the corpus size: at most ``4 * workers`` chunks and
``4 * workers * 256 KiB`` of input are in flight, except that a longer line goes alone and its
result comes back before the next line is read. Such a line of ``L`` bytes is held about 2
times (bytes per byte measured: 2.0 with one process; 1.7-2.1 in the main process and 1.5
in a worker with two), never once per worker or per chunk in flight: the raw bytes are released once
decoded, the decoded line once parsed, the text once tokenized. Add the tokenizer's own working
set: SentencePiece needs about 45 bytes per input byte in one call (one 51 MB line: 2.35 GB
peak), so with a BPE model whose pieces never span a space (LLaMA's, checked from the model) a
text longer than ``PIECE_CHARS`` characters is tokenized in pieces cut at single spaces between
two non-space characters, which gives the same ids as one call (tested; 0.16 GB peak for that
line, and 3x faster); other tokenizers take the whole text at once.
``tests/e2e/tools/test_preprocess_memory.py`` measures it.

Empty documents (texts that tokenize to nothing) are recorded as Megatron-LM records them, an
entry of the document index without a sequence (``add_document([], [])``, no EOD either), so the
``.idx`` is byte-identical to Megatron-LM's; the summary counts them.

A worker that dies (the out-of-memory killer) or stays stopped stops the run with one line naming
it and no output; the workers die with the main process (``megatron/data/worker_pool.py``).

Output is written to temporary names and renamed at the end, older ``.idx`` files of the outputs
first deleted, so a run killed at any point leaves no loadable partial dataset; the next run
deletes the temporaries it left (see ``megatron/data/indexed_dataset.py``). Nothing here imports
torch.
"""

from __future__ import annotations

import argparse
import collections
import gc
import glob
import gzip
import itertools
import json
import os
import sys
import time
from itertools import repeat
from operator import itemgetter
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetError, MMapIndexedDatasetBuilder, best_fitting_dtype, data_file_path, index_file_path)
from megatron.data.stop_signals import stop_in_one_line  # noqa: E402
from megatron.data.worker_pool import WorkerDied, WorkerPool  # noqa: E402
from megatron.tokenizer import add_tokenizer_args, build_tokenizer  # noqa: E402

CHUNK_BYTES = 256 * 1024  # small enough to balance 77 play-sized documents over the workers
PIECE_CHARS = 1 << 16     # longer texts are tokenized in pieces where that gives the same ids
PIECES_PER_CALL = 16      # pieces of one text per tokenizer call (about 1 M characters)
INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")


class InputError(ValueError):
    """A line of the input cannot be used; the message names file and line number."""


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True,
                       help="A .jsonl or .jsonl.gz file, a glob of them, or a folder holding them.")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="Keys of the JSON objects to tokenize; one output dataset per key.")
    group.add_argument("--keep-newlines", action="store_true",
                       help="Megatron's flag; it only affects sentence splitting, which this tool does not do.")
    group.add_argument("--skip-invalid", action="store_true",
                       help="Skip (and count) malformed JSON lines or lines missing a key instead of stopping.")
    add_tokenizer_args(parser)
    group = parser.add_argument_group("tokenization")
    group.add_argument("--append-eod", action="store_true", help="Append the end-of-document id to each document.")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="Output files are {prefix}_{key}_document.bin/.idx.")
    group.add_argument("--dataset-impl", type=str, default="mmap", choices=["mmap"],
                       help="Accepted for Megatron compatibility; mmap is the only format.")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="Tokenizer processes (1: tokenize in this process).")
    group.add_argument("--chunk-size", type=int, default=1024, help="Most documents per chunk sent to a worker.")
    group.add_argument("--log-interval", type=int, default=10000,
                       help="Documents between progress lines when stderr is not a terminal.")
    args = parser.parse_args(argv)
    if args.tokenizer_type is None:
        parser.error("--tokenizer-type is required")
    for flag in ("workers", "chunk_size", "log_interval"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    repeated = sorted({k for k in args.json_keys if args.json_keys.count(k) > 1})
    if repeated:
        parser.error(f"--json-keys ({' '.join(args.json_keys)}): {', '.join(repeated)} given more than "
                     "once, and each key writes its own output file; give every key once")
    return args


def input_files(pattern: str) -> List[str]:
    """The files ``--input`` names: a file, a folder (its ``.jsonl[.gz]``/``.json[.gz]`` files) or a glob.

    Raises:
        FileNotFoundError: nothing matches.
    """
    if os.path.isdir(pattern):
        files = sorted(os.path.join(pattern, n) for n in os.listdir(pattern) if n.endswith(INPUT_SUFFIXES))
    elif os.path.isfile(pattern):
        files = [pattern]
    else:
        files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    if not files:
        raise FileNotFoundError(f"--input {pattern}: no such file, and no .jsonl/.jsonl.gz files match it")
    return files


def _groups(lines: List[bytes], chunk_size: int, chunk_bytes: int) -> Iterator[Tuple[int, int]]:
    """Index ranges of at most ``chunk_size`` lines; a line longer than ``chunk_bytes`` alone."""
    if len(lines) == 1 or max(map(len, lines)) <= chunk_bytes:
        for start in range(0, len(lines), chunk_size):
            yield start, min(start + chunk_size, len(lines))
        return
    start = 0
    for i, raw in enumerate(lines + [b""]):
        if i == len(lines) or len(raw) > chunk_bytes:
            for s in range(start, i, chunk_size):
                yield s, min(s + chunk_size, i)
            if i < len(lines):
                yield i, i + 1
            start = i + 1


def read_chunks(files: List[str], chunk_size: int,
                chunk_bytes: int = CHUNK_BYTES) -> Iterator[Tuple[str, int, List[bytes]]]:
    """Yields ``(path, number of the chunk's first line, [whole lines as one bytes])`` in input order.

    The bytes come in a one-item list that nothing else refers to: :func:`encode_chunk` takes
    them out, so a huge line is freed as soon as it is decoded.
    """
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            line = 1
            while True:
                lines = f.readlines(chunk_bytes)
                if not lines:
                    break
                for start, stop in _groups(lines, chunk_size, chunk_bytes):
                    if stop - start == 1:
                        box, lines[start] = [lines[start]], None
                    else:
                        box = [b"".join(lines[start:stop])]
                    yield path, line, box
                    line += stop - start


# State of a worker process (or of the main process with --workers 1), set by _init_worker.
_W: Dict = {}


def _init_worker(args: argparse.Namespace, tokenizer=None) -> None:
    tokenizer = tokenizer or build_tokenizer(args)
    _W.update(tokenizer=tokenizer, keys=list(args.json_keys), skip=args.skip_invalid,
              eod=tokenizer.eod if args.append_eod else None,
              dtype=best_fitting_dtype(tokenizer.vocab_size), scan=json.JSONDecoder().scan_once,
              piece_chars=PIECE_CHARS if splits_at_spaces(tokenizer) else 0)


def splits_at_spaces(tokenizer) -> bool:
    """Whether ``ids(t) == ids(t[:i]) + ids(t[i + 1:])`` wherever ``t[i]`` is a space between two
    characters that are neither a space nor U+2581 (SentencePiece's space symbol).

    True for a SentencePiece BPE model whose normalizer is the identity, which adds the dummy
    prefix, marks spaces as prefixes, has no user-defined pieces and no piece holding U+2581
    after another character (LLaMA's, Mistral's): the right part's dummy prefix then stands for
    the space cut out, and no merge can join the last symbol before a space to the symbols from
    it on, so both sides are merged alone. Anything else (or no protobuf to read the model): False.
    """
    from megatron.tokenizer.sp_tokenizer import SentencePieceTokenizer

    if not isinstance(tokenizer, SentencePieceTokenizer):
        return False
    try:
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()
        with open(tokenizer.model_file, "rb") as f:
            model.ParseFromString(f.read())
    except Exception:  # noqa: BLE001 - no protobuf, or an unreadable model: do not split
        return False
    spec, norm = model.trainer_spec, model.normalizer_spec
    if (spec.model_type != spec.BPE or spec.treat_whitespace_as_suffix or norm.precompiled_charsmap
            or not norm.add_dummy_prefix or not norm.escape_whitespaces):
        return False
    user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    return not any(p.type == user_defined or "\u2581" in p.piece.lstrip("\u2581") for p in model.pieces)


def _pieces(text: str, limit: int) -> Iterator[str]:
    """``text`` cut at spaces between two characters other than a space and U+2581, each piece
    at most about ``limit`` characters where such spaces allow (see :func:`splits_at_spaces`)."""
    start = 0
    while len(text) - start > limit:
        cut = _cut_point(text, start + limit // 2, start + limit)
        if cut < 0:
            break
        yield text[start:cut]
        start = cut + 1
    yield text[start:] if start else text


def _cut_point(text: str, lo: int, hi: int) -> int:
    """A space in ``[lo, hi)`` (the last one), else the first after ``hi``, with both neighbours
    other than a space and U+2581; -1 when there is none."""
    def ok(i):
        return 0 < i < len(text) - 1 and text[i - 1] not in " \u2581" and text[i + 1] not in " \u2581"

    i = text.rfind(" ", lo, hi)
    while i >= lo:
        if ok(i):
            return i
        i = text.rfind(" ", lo, i)
    i = text.find(" ", hi)
    while i >= 0:
        if ok(i):
            return i
        i = text.find(" ", i + 1)
    return -1


def _decode(chunk: bytes) -> Tuple[List[str], int]:
    """Lines of the chunk and how many of them held invalid UTF-8 (replaced by U+FFFD)."""
    try:
        newlines = chunk.count(b"\n")
        if newlines == 0 or (newlines == 1 and chunk.endswith(b"\n")):
            # One line, maybe huge: decoded in place, without the copy a split makes.
            view = memoryview(chunk)
            return [str(view[:-1] if newlines else view, "utf-8")], 0
        return chunk.decode("utf-8").split("\n"), 0
    except UnicodeDecodeError:
        lines, bad = [], 0
        for raw in chunk.split(b"\n"):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                lines.append(raw.decode("utf-8", errors="replace"))
                bad += 1
        return lines, bad


def _parse(line: str, where: str, keys: List[str]) -> List[str]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply to read; fix the line or pass "
                         "--skip-invalid") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    texts = []
    for key in keys:
        if key not in obj:
            raise InputError(f"{where}: no key {key!r} (keys there: {', '.join(map(repr, obj))}); "
                             "choose the field with --json-keys")
        if not isinstance(obj[key], str):
            raise InputError(f"{where}: {key!r} is a {type(obj[key]).__name__}, expected a string")
        try:
            obj[key].encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"{where}: {key!r} holds a lone surrogate "
                             f"({ascii(obj[key][e.start])} at character {e.start}: a \\u escape "
                             "of half a UTF-16 pair), which is no text; fix the line or pass "
                             "--skip-invalid") from None
        texts.append(obj[key])
    return texts


def _parse_fast(lines: List[str], keys: List[str], scan) -> Optional[List[List[str]]]:
    """Texts per key when every line is exactly one JSON object holding string values; else None.

    The common case without a Python call per line: ``scan`` is json's C scanner (what
    ``json.loads`` runs), mapped over the lines. Anything unusual (blank lines, surrounding
    whitespace, a bad line) returns None and ``_parse_slow`` redoes the chunk, naming the line.
    """
    try:
        parsed = list(map(scan, lines, repeat(0)))  # a StopIteration (no value) just ends the list
        if len(parsed) != len(lines) or not parsed:
            return None
        objs, ends = zip(*parsed)
        if list(ends) != list(map(len, lines)) or set(map(type, objs)) != {dict}:
            return None
        per_key = [list(map(itemgetter(key), objs)) for key in keys]
    except (ValueError, KeyError, RecursionError):
        return None
    if any(set(map(type, texts)) != {str} for texts in per_key):
        return None
    return per_key


def _parse_slow(lines: List[str], path: str, first_line: int) -> Tuple[List[List[str]], int]:
    """Texts per key and the number of invalid lines skipped; the first bad line raises without ``--skip-invalid``."""
    keys, per_key, invalid = _W["keys"], [[] for _ in _W["keys"]], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            texts = _parse(line, f"{path}:{first_line + i}", keys)
        except InputError:
            if not _W["skip"]:
                raise
            invalid += 1
            continue
        for bucket, text in zip(per_key, texts):
            bucket.append(text)
    return per_key, invalid


def _tokenize_texts(texts: List[str]) -> Tuple[np.ndarray, np.ndarray]:
    """``(flat ids, int64 lengths)``; texts longer than the piece limit go piece by piece."""
    tokenizer, dtype, limit = _W["tokenizer"], _W["dtype"], _W["piece_chars"]
    if not limit or all(len(t) <= limit for t in texts):
        return tokenizer.tokenize_batch_flat(texts, dtype=dtype)
    flats, lengths, i = [], [], 0
    while i < len(texts):
        j = i
        while j < len(texts) and len(texts[j]) <= limit:
            j += 1
        if j > i:
            flat, n = tokenizer.tokenize_batch_flat(texts[i:j], dtype=dtype)
            flats.append(flat)
            lengths.append(n)
        if j < len(texts):
            pieces, total = _pieces(texts[j], limit), 0
            while True:
                batch = list(itertools.islice(pieces, PIECES_PER_CALL))
                if not batch:
                    break
                flat = tokenizer.tokenize_batch_flat(batch, dtype=dtype)[0]
                flats.append(flat)
                total += flat.size
            lengths.append(np.array([total], dtype=np.int64))
            j += 1
        i = j
    return np.concatenate(flats), np.concatenate(lengths)


def _tokenize(texts: List[str]) -> Tuple[np.ndarray, np.ndarray]:
    """``(flat tokens, int32 lengths)``, EOD appended to every document that tokenizes to
    something; an empty one keeps length 0 and gets no EOD (Megatron-LM's ``encode``)."""
    flat, lengths = _tokenize_texts(texts)
    if _W["eod"] is not None and len(lengths):
        nonempty = lengths > 0
        flat = np.insert(flat, np.cumsum(lengths)[nonempty], np.asarray(_W["eod"], dtype=flat.dtype))
        lengths = lengths + nonempty
    return flat, lengths.astype(np.int32)


def encode_chunk(path: str, first_line: int, chunk) -> dict:
    """Tokenizes one chunk of lines (runs in a worker).

    Args:
        chunk: the lines as bytes, or a one-item list holding them (taken out of it, so that a
            huge line is freed once decoded; :func:`read_chunks` yields that).

    Returns:
        ``{"keys": [(flat token array, int32 document lengths) per key], "lines", "invalid",
        "bad_utf8", "empty": [per key], "bytes"}``; a document that tokenizes to nothing has
        length 0.

    Raises:
        InputError: a malformed line without ``--skip-invalid``.
    """
    if isinstance(chunk, list):
        chunk = chunk.pop()
    nbytes = len(chunk)
    lines, bad_utf8 = _decode(chunk)
    del chunk
    if lines and lines[-1] == "":
        lines.pop()
    # A "\\udXXX" escape can decode to a lone surrogate, which is no Unicode text and which a
    # tokenizer rejects with a raw error: such chunks take the slow path, which names the line.
    escapes = any("\\ud" in line or "\\uD" in line for line in lines)
    per_key, invalid = (None if escapes else _parse_fast(lines, _W["keys"], _W["scan"])), 0
    if per_key is None:
        per_key, invalid = _parse_slow(lines, path, first_line)
    del lines  # the texts are their own strings now
    out = {"keys": [], "empty": [], "lines": len(per_key[0]), "invalid": invalid, "bad_utf8": bad_utf8,
           "bytes": nbytes}
    for k in range(len(per_key)):
        texts, per_key[k] = per_key[k], None
        flat, lengths = _tokenize(texts)
        del texts
        out["keys"].append((flat, lengths))
        out["empty"].append(int(np.count_nonzero(lengths == 0)))
    return out


def _in_order(pool, chunks, window: int, budget: int):
    """Results of ``encode_chunk`` over ``chunks`` in input order, at most ``window`` chunks and
    ``budget`` input bytes in flight; a larger chunk goes alone, and its result comes back before
    the next chunk is read (reading is far faster than tokenizing such a line). No local name
    keeps a result or a chunk once it is handed on."""
    pending, in_flight = collections.deque(), [0]

    def oldest():
        in_flight[0] -= pending[0][1]
        return pool.result(pending.popleft()[0])

    for path, line, box in chunks:
        size = len(box[0])
        while pending and (len(pending) >= window or in_flight[0] + size > budget):
            yield oldest()
        # A fresh box, the yielded one emptied: once the task is sent, no one here holds the bytes.
        pending.append((pool.submit(encode_chunk, path, line, [box.pop()]), size))
        in_flight[0] += size
        if size > budget:
            while pending:
                yield oldest()
    while pending:
        yield oldest()


class _Progress:
    """tqdm bar (bytes, with documents/s and tokens/s) on a terminal; log lines otherwise."""

    def __init__(self, total_bytes: Optional[int], log_interval: int):
        from tqdm import tqdm

        self.start, self.docs, self.tokens, self.bytes = time.time(), 0, 0, 0
        self.log_interval, self.next_log = log_interval, log_interval
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr,
                        disable=not sys.stderr.isatty(), smoothing=0.1)

    def rates(self) -> str:
        dt = max(time.time() - self.start, 1e-9)
        return (f"{self.docs / dt:,.0f} docs/s, {self.bytes / dt / 1e6:.2f} MB/s, "
                f"{self.tokens / dt:,.0f} tokens/s")

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs, self.tokens, self.bytes = self.docs + docs, self.tokens + tokens, self.bytes + nbytes
        if not self.bar.disable:
            self.bar.update(nbytes)
            dt = max(time.time() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{self.docs / dt:,.0f} docs/s, {self.tokens / dt:,.0f} tok/s", refresh=False)
        elif self.docs >= self.next_log:
            print(f"Processed {self.docs:,} documents ({self.rates()})", file=sys.stderr, flush=True)
            self.next_log = (self.docs // self.log_interval + 1) * self.log_interval

    def close(self) -> None:
        self.bar.close()


def run(args: argparse.Namespace) -> dict:
    """Preprocesses as ``args`` say; returns the summary (also printed).

    Raises:
        InputError: a malformed line (without ``--skip-invalid``); no output is left behind.
        FileNotFoundError / ValueError: bad ``--input`` or tokenizer flags.
    """
    files = input_files(args.input)
    tokenizer = build_tokenizer(args)
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    if args.append_eod:
        tokenizer.eod  # noqa: B018 - fail now, not in a worker, when the tokenizer has none
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    prefixes = [f"{args.output_prefix}_{key}_document" for key in args.json_keys]
    total = None if any(f.endswith(".gz") for f in files) else sum(os.path.getsize(f) for f in files)
    stats = {"documents": [0] * len(prefixes), "empty": [0] * len(prefixes), "tokens": [0] * len(prefixes),
             "invalid": 0, "bad_utf8": 0, "bytes": 0}
    builders, pool, progress = [], None, _Progress(total, args.log_interval)
    start = time.time()
    try:
        chunks = read_chunks(files, args.chunk_size)
        if args.workers == 1:
            _init_worker(args, tokenizer)
            results = (encode_chunk(*chunk) for chunk in chunks)
        else:
            # Forked workers inherit the tokenizer (spawned ones rebuild it from its file); the
            # frozen heap keeps their garbage collector off the parent's pages (no copy-on-write).
            # Started before the output files are opened, so no worker holds their locks.
            gc.freeze()
            try:
                pool = WorkerPool(args.workers, _init_worker, (args, tokenizer), what="tokenizer worker",
                                  advice="rerun, with fewer --workers or a smaller --chunk-size if "
                                         "memory ran out")
            finally:
                gc.unfreeze()
            results = _in_order(pool, chunks, window=4 * args.workers, budget=4 * args.workers * CHUNK_BYTES)
        builders = [MMapIndexedDatasetBuilder(data_file_path(p), dtype) for p in prefixes]
        for res in results:
            for k, (builder, (flat, lengths)) in enumerate(zip(builders, res["keys"])):
                builder.add_documents(flat, lengths)
                stats["documents"][k] += len(lengths)
                stats["tokens"][k] += flat.size
                stats["empty"][k] += res["empty"][k]
            for name in ("invalid", "bad_utf8", "bytes"):
                stats[name] += res[name]
            progress.update(res["lines"], res["keys"][0][0].size, res["bytes"])
            del res
        if pool is not None:  # let workers exit normally (their CPU time then shows in rusage)
            pool.close()
            pool = None
        # Every older index goes before any new file takes its name: an interrupted commit
        # leaves no output of this run paired with one of an earlier run.
        for prefix in prefixes:
            if os.path.lexists(index_file_path(prefix)):
                os.remove(index_file_path(prefix))
        for builder, prefix in zip(builders, prefixes):
            builder.finalize(index_file_path(prefix))
    except BaseException:
        for builder in builders:
            builder.abort()
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
    stats["seconds"] = time.time() - start
    stats["outputs"], stats["dtype"] = prefixes, np.dtype(dtype).name
    _print_summary(stats, args, len(files))
    return stats


def _print_summary(stats: dict, args: argparse.Namespace, n_files: int) -> None:
    dt = max(stats["seconds"], 1e-9)
    for k, prefix in enumerate(stats["outputs"]):
        print(f"Wrote {prefix}.bin/.idx: {stats['documents'][k]:,} documents, {stats['tokens'][k]:,} tokens "
              f"({stats['dtype']}), {os.path.getsize(data_file_path(prefix)):,} bytes; "
              f"{stats['empty'][k]:,} of the documents tokenize to nothing (recorded empty, as "
              "Megatron-LM does)")
    if stats["invalid"]:
        print(f"Skipped {stats['invalid']:,} invalid lines (--skip-invalid)")
    if stats["bad_utf8"]:
        print(f"Replaced invalid UTF-8 in {stats['bad_utf8']:,} lines")
    docs, tokens = sum(stats["documents"]), sum(stats["tokens"])
    print(f"Read {stats['bytes'] / 1e6:,.2f} MB from {n_files} file(s) in {dt:.2f} s with {args.workers} "
          f"worker(s): {docs / dt:,.0f} docs/s, {stats['bytes'] / dt / 1e6:.2f} MB/s, {tokens / dt:,.0f} tokens/s")


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        with stop_in_one_line("preprocess_data.py"):  # unwinds through run(): temporaries removed
            run(args)
    except (InputError, FileNotFoundError, FileExistsError, IndexedDatasetError, ValueError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 2  # argparse's status for a usage error: the input is the user's to fix
    except WorkerDied as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
