"""Tokenize conversations (JSON lines) into Megatron ``.bin/.idx`` token and loss-mask datasets.

The post-training sibling of ``tools/preprocess_data.py`` (same input, tokenizer and output
flags). Each line is one conversation in the OpenAI/HF ``messages`` format, ShareGPT
``conversations`` or Alpaca ``instruction``/``input``/``output`` (detected per line, or named
with ``--conversation-format``). It is rendered with the tokenizer's own chat template (an HF
folder, run only in transformers' sandboxed Jinja) or a built-in one (``--chat-template
llama2|llama3|chatml`` for SentencePiece models); see ``megatron/data/chat_templates.py``.
Example::

    python tools/preprocess_sft_data.py --input chats.jsonl --output-prefix data/chats \\
        --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --chat-template llama2

Outputs (one document per conversation, the same document boundaries in both):

- ``{prefix}_text_document.bin/.idx``: the token ids (``best_fitting_dtype`` of the vocabulary),
- ``{prefix}_text_loss_mask_document.bin/.idx``: uint8, 1 on the tokens of every assistant turn (its
  content and end-of-turn marker), 0 elsewhere,
- ``{prefix}_report.json``: counts and the line numbers of every skipped conversation.

With ``--preference-pairs`` each line holds ``chosen`` and ``rejected`` (a string: one assistant
reply; or a list of messages) and an optional ``prompt`` (a string: one user turn; or a list of
messages); the outputs are ``{prefix}_chosen_document``, ``{prefix}_chosen_loss_mask_document``,
``{prefix}_rejected_document`` and ``{prefix}_rejected_loss_mask_document``, document ``k`` of
each being pair ``k``; the masks cover the response only (the messages after the prompt). A pair
whose two sides' prompt tokens (those before the first masked token) differ is skipped and listed
(``prompt_mismatch``): the tokenizer merged across the prompt's end differently. A pair whose
two sides are the same tokens is skipped and listed (``same_response``): its DPO loss is log 2
with no gradient and its reward-model loss teaches nothing.

A conversation whose mask comes out empty (no assistant token: no assistant turn, or one the
template drops) or all ones (nothing but assistant tokens: no prompt) is never trained on: it is
skipped, counted, and its line listed in the summary and the report. A line that is not a
conversation (including one that is not UTF-8: it is never replaced with U+FFFD and trained
on) stops the run with its file and line number (exit 2), or with ``--skip-invalid``
is skipped and listed likewise. Outputs are written to temporary names and renamed at the end,
so a failed run leaves no partial dataset.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data.chat_templates import (  # noqa: E402
    BUILTIN_TEMPLATES, CONVERSATION_FORMATS, ConversationError, build_chat_tokenizer, to_messages)
from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetError, MMapIndexedDatasetBuilder, best_fitting_dtype, data_file_path, index_file_path)
from megatron.data.stop_signals import stop_in_one_line  # noqa: E402
from megatron.data.worker_pool import WorkerDied, WorkerPool  # noqa: E402
from megatron.text_checks import lone_surrogate  # noqa: E402
from megatron.tokenizer import add_tokenizer_args  # noqa: E402
from megatron.usage_error import run_command  # noqa: E402

LINES_PER_CHUNK = 256
LISTED = 20  # skipped line numbers printed per reason (all of them go to the report)
SKIP_REASONS = ("invalid", "empty_mask", "all_ones_mask", "prompt_mismatch", "same_response")


class InputError(ValueError):
    """A line of the input is not a conversation; the message names file and line."""


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True,
                       help="A .jsonl or .jsonl.gz file, a glob of them, or a folder holding them.")
    group.add_argument("--conversation-format", default="auto", choices=("auto",) + CONVERSATION_FORMATS,
                       help="messages (OpenAI/HF), sharegpt (conversations: from/value), alpaca "
                            "(instruction/input/output); auto detects it per line.")
    group.add_argument("--preference-pairs", action="store_true",
                       help="Lines are preference pairs (prompt, chosen, rejected) for DPO / reward models.")
    group.add_argument("--skip-invalid", action="store_true",
                       help="Skip (count and list) lines that are not conversations instead of stopping.")
    add_tokenizer_args(parser)
    group = parser.add_argument_group("chat template")
    group.add_argument("--chat-template", default=None, choices=tuple(BUILTIN_TEMPLATES),
                       help="Built-in format for a SentencePiece model; an HF folder uses its own template.")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="Outputs are {prefix}_text_document and {prefix}_text_loss_mask_document .bin/.idx.")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="Tokenizer processes (1: in this process).")
    args = parser.parse_args(argv)
    if args.tokenizer_type is None:
        parser.error("--tokenizer-type is required")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1 (got {args.workers})")
    return args


def input_files(pattern: str) -> List[str]:
    from tools.preprocess_data import input_files as files  # one rule for what --input names

    return files(pattern)


def read_chunks(files: List[str]) -> Iterator[Tuple[str, int, List[str]]]:
    """``(path, first line number, lines as bytes)`` in input order (decoded per line, so a
    line that is not UTF-8 is named by its number)."""
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            lines, first = [], 1
            for n, line in enumerate(f, 1):
                lines.append(line)
                if len(lines) == LINES_PER_CHUNK:
                    yield path, first, lines
                    lines, first = [], n + 1
            if lines:
                yield path, first, lines


def pair_messages(obj: dict, side: str) -> Tuple[List[dict], int]:
    """The messages of one side of a preference pair and the index of its first response message.

    Raises:
        ConversationError: no ``chosen``/``rejected``, or a part that is neither a string nor a
            list of OpenAI messages.
    """
    if not isinstance(obj, dict) or side not in obj:
        raise ConversationError(f"a preference pair needs 'chosen' and 'rejected' (keys: "
                                f"{', '.join(map(repr, obj)) if isinstance(obj, dict) else type(obj).__name__})")

    def part(value, role):
        if isinstance(value, str):
            return [{"role": role, "content": value}]
        return to_messages({"messages": value}, "messages") if value is not None else []

    prompt = part(obj.get("prompt"), "user")
    return prompt + part(obj[side], "assistant"), len(prompt)


_W: Dict = {}


def _init_worker(args: argparse.Namespace, chat=None) -> None:
    _W.update(chat=chat or build_chat_tokenizer(args.tokenizer_type, args.tokenizer_model,
                                                args.tokenizer_name_or_path, args.chat_template),
              fmt=None if args.conversation_format == "auto" else args.conversation_format,
              pairs=args.preference_pairs, skip=args.skip_invalid)


def _check_mask(mask: np.ndarray) -> Optional[str]:
    if not mask.any():
        return "empty_mask"
    if mask.all():
        return "all_ones_mask"
    return None


def encode_line(line: str):
    """``("ok", [(ids, mask) per output side])`` or ``(reason, message)``."""
    obj = json.loads(line)
    bad = lone_surrogate(obj)
    if bad is not None:  # the tokenizer would fail on it with a raw library error
        raise ConversationError(f"{bad[0] or 'the line'} holds a lone surrogate (U+{bad[1]:04X}: "
                                "a \\u escape of half a UTF-16 pair), which is no text; fix the "
                                "line or pass --skip-invalid")
    sides = []
    if _W["pairs"]:
        for side in ("chosen", "rejected"):
            messages, first = pair_messages(obj, side)
            sides.append(_W["chat"].encode(messages, first))
    else:
        sides.append(_W["chat"].encode(to_messages(obj, _W["fmt"])))
    for ids, mask in sides:
        bad = _check_mask(mask)
        if bad:
            return bad, ""
    if len(sides) == 2:  # DPO compares the two responses after one and the same prompt
        (a, ma), (b, mb) = sides
        pa, pb = int(np.argmax(ma)), int(np.argmax(mb))
        if pa != pb or not np.array_equal(a[:pa], b[:pb]):
            return "prompt_mismatch", ""
        if np.array_equal(a, b):
            return "same_response", ""
    return "ok", sides


def encode_chunk(path: str, first_line: int, lines: List[bytes]) -> List[Tuple[int, str, object]]:
    """``[(line number, status, sides or message)]`` for the non-blank lines of a chunk.

    Raises:
        InputError: a line that is not a conversation, without ``--skip-invalid``.
    """
    out = []
    for n, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            status, value = encode_line(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, ConversationError, RecursionError) as e:
            what = ("not UTF-8" if isinstance(e, UnicodeDecodeError) else
                    "malformed JSON" if isinstance(e, json.JSONDecodeError) else
                    "JSON nested too deeply" if isinstance(e, RecursionError) else
                    "not a conversation")
            message = f"{path}:{n}: {what} ({str(e)[:300]})"
            if not _W["skip"]:
                raise InputError(message) from None
            status, value = "invalid", message
        out.append((n, status, value))
    return out


def output_prefixes(prefix: str, pairs: bool) -> List[Tuple[str, str]]:
    """``(tokens prefix, mask prefix)`` per output side."""
    if pairs:
        return [(f"{prefix}_{s}_document", f"{prefix}_{s}_loss_mask_document") for s in ("chosen", "rejected")]
    return [(f"{prefix}_text_document", f"{prefix}_text_loss_mask_document")]


def run(args: argparse.Namespace) -> dict:
    """Preprocesses as ``args`` say; returns the report (also written and summarised)."""
    files = input_files(args.input)
    chat = build_chat_tokenizer(args.tokenizer_type, args.tokenizer_model, args.tokenizer_name_or_path,
                                args.chat_template)
    dtype = best_fitting_dtype(chat.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    prefixes = output_prefixes(args.output_prefix, args.preference_pairs)
    report = {"conversations": 0, "tokens": [0] * len(prefixes), "loss_tokens": [0] * len(prefixes),
              "skipped": {r: [] for r in SKIP_REASONS}, "invalid_messages": [],
              "outputs": [list(p) for p in prefixes], "dtype": np.dtype(dtype).name}
    builders, pool, start = [], None, time.time()
    try:
        chunks = read_chunks(files)
        if args.workers == 1:
            _init_worker(args, chat)
            results = (encode_chunk(*c) for c in chunks)
        else:
            pool = WorkerPool(args.workers, _init_worker, (args, chat), what="tokenizer worker")
            results = pool.ordered(encode_chunk, chunks, window=4 * args.workers)
        builders = [(MMapIndexedDatasetBuilder(data_file_path(t), dtype),
                     MMapIndexedDatasetBuilder(data_file_path(m), np.uint8)) for t, m in prefixes]
        for res in results:
            for line, status, value in res:
                if status != "ok":
                    report["skipped"][status].append(line)
                    if status == "invalid":
                        report["invalid_messages"].append(value)
                    continue
                report["conversations"] += 1
                for k, ((tb, mb), (ids, mask)) in enumerate(zip(builders, value)):
                    tb.add_document(ids, [ids.size])
                    mb.add_document(mask, [mask.size])
                    report["tokens"][k] += int(ids.size)
                    report["loss_tokens"][k] += int(mask.sum())
        if pool is not None:
            pool.close()
            pool = None
        if report["conversations"] == 0:
            raise InputError(f"--input {args.input}: no conversation left to write (skipped: "
                             + ", ".join(f"{len(v)} {k}" for k, v in report["skipped"].items()) + ")")
        for pair in prefixes:
            for p in pair:
                if os.path.lexists(index_file_path(p)):
                    os.remove(index_file_path(p))
        for (tb, mb), (t, m) in zip(builders, prefixes):
            tb.finalize(index_file_path(t))
            mb.finalize(index_file_path(m))
    except BaseException:
        for pair in builders:
            for b in pair:
                b.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    report["seconds"] = round(time.time() - start, 3)
    with open(f"{args.output_prefix}_report.json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    _print_summary(report, args)
    return report


def _print_summary(report: dict, args: argparse.Namespace) -> None:
    for k, (t, m) in enumerate(report["outputs"]):
        share = report["loss_tokens"][k] / max(report["tokens"][k], 1)
        print(f"Wrote {t}.bin/.idx and {m}.bin/.idx: {report['conversations']:,} conversations, "
              f"{report['tokens'][k]:,} tokens ({report['dtype']}), {report['loss_tokens'][k]:,} in the "
              f"loss mask ({share:.1%})")
    why = {"invalid": "not conversations (--skip-invalid)",
           "empty_mask": "with an empty loss mask (no assistant token)",
           "all_ones_mask": "with an all-ones loss mask (no prompt)",
           "prompt_mismatch": "whose chosen and rejected prompts tokenize differently",
           "same_response": "whose chosen and rejected responses are the same"}
    for reason, lines in report["skipped"].items():
        if lines:
            listed = ", ".join(map(str, lines[:LISTED])) + (", ..." if len(lines) > LISTED else "")
            print(f"Skipped {len(lines):,} conversations {why[reason]}: lines {listed}")
    print(f"Report: {args.output_prefix}_report.json ({report['seconds']:.2f} s, {args.workers} worker(s))")


def main(argv: Optional[List[str]] = None) -> None:
    args = get_args(argv)
    with stop_in_one_line("preprocess_sft_data.py"):  # unwinds through run(): temporaries removed
        run(args)


USAGE_ERRORS = (InputError, FileNotFoundError, FileExistsError, IndexedDatasetError, ValueError)


def cli(argv: Optional[List[str]] = None) -> int:
    """The command: 0; 2 after one line ``preprocess_sft_data.py: error: ...`` on stderr; 1 after
    one such line when a worker died or stayed stopped (nothing written)."""
    try:
        return run_command("preprocess_sft_data.py", main, argv, usage_errors=USAGE_ERRORS)
    except WorkerDied as e:
        print(f"preprocess_sft_data.py: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
