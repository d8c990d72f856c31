"""Tokenize JSON lines into Megatron's mmap indexed dataset (``{prefix}_{key}_document.bin/.idx``).

Megatron-LM's ``tools/preprocess_data.py`` flags and output, byte for byte: run on the same input
with the same tokenizer and ``--append-eod`` it writes the same files (tested against a vector
written by Megatron-LM). Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --append-eod --workers 8

Parallelism: the main process reads the input as raw bytes in chunks of whole lines (at most
``--chunk-size`` documents and about 256 KiB each) and hands them to ``--workers`` processes, which
decode, parse and tokenize a chunk with the tokenizer's batch path and send back each key's tokens
as one flat array plus the document lengths. The main process writes the chunks in input order,
so the output does not depend on ``--workers``, and it never unpickles per document, so it keeps
up with many workers even for small documents. At most ``4 * workers`` chunks are in flight:
memory is bounded by the chunk size, not the corpus size. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import collections
import gc
import glob
import gzip
import json
import multiprocessing
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
from megatron.tokenizer import add_tokenizer_args, build_tokenizer  # noqa: E402

CHUNK_BYTES = 256 * 1024  # small enough to balance 77 play-sized documents over the workers
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


def read_chunks(files: List[str], chunk_size: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Tuple[str, int, bytes]]:
    """Yields ``(path, number of the chunk's first line, whole lines as bytes)`` in input order."""
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            line = 1
            while True:
                lines = f.readlines(chunk_bytes)
                if not lines:
                    break
                for start in range(0, len(lines), chunk_size):
                    part = lines[start:start + chunk_size]
                    yield path, line, b"".join(part)
                    line += len(part)


# State of a worker process (or of the main process with --workers 1), set by _init_worker.
_W: Dict = {}


def _init_worker(args: argparse.Namespace, tokenizer=None) -> None:
    tokenizer = tokenizer or build_tokenizer(args)
    _W.update(tokenizer=tokenizer, keys=list(args.json_keys), skip=args.skip_invalid,
              eod=tokenizer.eod if args.append_eod else None,
              dtype=best_fitting_dtype(tokenizer.vocab_size), scan=json.JSONDecoder().scan_once)


def _decode(chunk: bytes) -> Tuple[List[str], int]:
    """Lines of the chunk and how many of them held invalid UTF-8 (replaced by U+FFFD)."""
    try:
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
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    texts = []
    for key in keys:
        if key not in obj:
            raise InputError(f"{where}: no key {key!r} (keys there: {', '.join(map(repr, obj))}); "
                             "choose the field with --json-keys")
        if not isinstance(obj[key], str):
            raise InputError(f"{where}: {key!r} is a {type(obj[key]).__name__}, expected a string")
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


def _tokenize(texts: List[str]) -> Tuple[np.ndarray, np.ndarray]:
    """``(flat tokens, int32 lengths)`` of the documents that tokenize to something, EOD appended."""
    flat, lengths = _W["tokenizer"].tokenize_batch_flat(texts, dtype=_W["dtype"])
    if not lengths.all():
        lengths = lengths[lengths > 0]  # empty documents add no tokens to flat
    if _W["eod"] is not None:
        flat = np.insert(flat, np.cumsum(lengths), np.asarray(_W["eod"], dtype=flat.dtype))
        lengths = lengths + 1
    return flat, lengths.astype(np.int32)


def encode_chunk(path: str, first_line: int, chunk: bytes) -> dict:
    """Tokenizes one chunk of lines (runs in a worker).

    Returns:
        ``{"keys": [(flat token bytes, int32 document lengths bytes) per key], "lines", "invalid",
        "bad_utf8", "empty": [per key], "bytes"}``; documents that tokenize to nothing are left out.

    Raises:
        InputError: a malformed line without ``--skip-invalid``.
    """
    lines, bad_utf8 = _decode(chunk)
    if lines and lines[-1] == "":
        lines.pop()
    per_key, invalid = _parse_fast(lines, _W["keys"], _W["scan"]), 0
    if per_key is None:
        per_key, invalid = _parse_slow(lines, path, first_line)
    out = {"keys": [], "empty": [], "lines": len(per_key[0]), "invalid": invalid, "bad_utf8": bad_utf8,
           "bytes": len(chunk)}
    for texts in per_key:
        flat, lengths = _tokenize(texts)
        out["keys"].append((flat.tobytes(), lengths.tobytes()))
        out["empty"].append(len(texts) - len(lengths))
    return out


def _in_order(pool, chunks, window: int):
    """Results of ``encode_chunk`` over ``chunks`` in input order, at most ``window`` in flight."""
    pending = collections.deque()
    for chunk in chunks:
        pending.append(pool.apply_async(encode_chunk, chunk))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


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
        builders = [MMapIndexedDatasetBuilder(data_file_path(p), dtype) for p in prefixes]
        chunks = read_chunks(files, args.chunk_size)
        if args.workers == 1:
            _init_worker(args, tokenizer)
            results = (encode_chunk(*chunk) for chunk in chunks)
        else:
            # Forked workers inherit the tokenizer (spawned ones rebuild it from its file); the
            # frozen heap keeps their garbage collector off the parent's pages (no copy-on-write).
            gc.freeze()
            try:
                pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args, tokenizer))
            finally:
                gc.unfreeze()
            results = _in_order(pool, chunks, window=4 * args.workers)
        for res in results:
            for k, (builder, (flat, lengths)) in enumerate(zip(builders, res["keys"])):
                lengths = np.frombuffer(lengths, dtype=np.int32)
                builder.add_documents(np.frombuffer(flat, dtype=dtype), lengths)
                stats["documents"][k] += len(lengths)
                stats["tokens"][k] += len(flat) // np.dtype(dtype).itemsize
                stats["empty"][k] += res["empty"][k]
            for name in ("invalid", "bad_utf8", "bytes"):
                stats[name] += res[name]
            progress.update(res["lines"], len(res["keys"][0][0]) // np.dtype(dtype).itemsize, res["bytes"])
        if pool is not None:  # let workers exit normally (their CPU time then shows in rusage)
            pool.close()
            pool.join()
            pool = None
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
            pool.join()
    stats["seconds"] = time.time() - start
    stats["outputs"], stats["dtype"] = prefixes, np.dtype(dtype).name
    _print_summary(stats, args, len(files))
    return stats


def _print_summary(stats: dict, args: argparse.Namespace, n_files: int) -> None:
    dt = max(stats["seconds"], 1e-9)
    for k, prefix in enumerate(stats["outputs"]):
        print(f"Wrote {prefix}.bin/.idx: {stats['documents'][k]:,} documents, {stats['tokens'][k]:,} tokens "
              f"({stats['dtype']}), {os.path.getsize(data_file_path(prefix)):,} bytes; skipped "
              f"{stats['empty'][k]:,} documents that tokenize to nothing")
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
        run(args)
    except (InputError, FileNotFoundError, IndexedDatasetError, ValueError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
