"""Sample continuations of prompts from a checkpoint at its TP/PP layout, with a KV cache.

Usage (TP x PP processes; the checkpoint's layout, or reshard it first with
``tools/checkpoint/convert.py --loader megatron --saver megatron``)::

    torchrun --nproc-per-node 4 tools/generate.py --load ckpt --prompt "To be, or not" \\
        --max-new-tokens 64 --greedy
    python tools/generate.py --load ckpt --prompt "ROMEO:" --temperature 0.8 --top-k 40 --top-p 0.9

The tokenizer comes from the checkpoint's stored ``--tokenizer-type`` / ``--tokenizer-model`` /
``--tokenizer-name-or-path`` unless given here. Rank 0 prints one sample per prompt.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="checkpoint folder (with the tracker file)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--max-new-tokens", "--out-seq-length", dest="max_new_tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="arg-max decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tokenizer-type", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--tokenizer-name-or-path", default=None,
                   help="HuggingFaceTokenizer folder (default: the checkpoint's)")
    p.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None)
    args = p.parse_args(argv)
    for i, text in enumerate(args.prompt, 1):
        try:  # bytes of the command line that are not UTF-8 arrive as lone surrogates
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            from megatron.usage_error import UsageError

            bad = text[e.start]
            raw = (f"byte {bad.encode('utf-8', 'surrogateescape')!r}" if "\udc80" <= bad <= "\udcff"
                   else f"lone surrogate {ascii(bad)}")
            raise UsageError(f"--prompt (number {i}) is not UTF-8 text: {raw} at character "
                             f"{e.start}; give the prompt in UTF-8 (e.g. convert it with iconv)") from None
    return args


def main(argv=None) -> list:
    """Generate; returns the texts (on every rank)."""
    from megatron.inference import generate
    from megatron.inference.launch import eod_of, open_checkpoint

    args = parse_args(argv)
    opened = open_checkpoint(args.load, args, distributed_backend=args.distributed_backend)
    try:
        tokenizer = opened.tokenizer
        prompts = [tokenizer.tokenize(text) for text in args.prompt]
        out = generate(opened.model, prompts, args.max_new_tokens, greedy=args.greedy,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       vocab_size=opened.vocab_size, eod=eod_of(tokenizer), seed=args.seed,
                       device=opened.device, pg_collection=opened.groups)
        texts = [tokenizer.detokenize(ids) for ids in out]
        import torch.distributed as dist

        if dist.get_rank() == 0:
            for text in texts:
                print(f"--- sample ---\n{text}", flush=True)
        return texts
    finally:
        opened.close()


def command(argv=None) -> int:
    """The command line: a wrong flag or input (a missing, damaged or refused checkpoint or
    tokenizer) is one line ``generate.py: error: ...`` and status 2 (argparse's convention), on
    rank 0 when every rank found it alike; anything else is a crash and keeps its traceback."""
    from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
    from megatron.usage_error import UsageError, run_command

    return run_command("generate.py", main, argv,
                       usage_errors=(UsageError, ValueError, FileNotFoundError, CheckpointError))


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(command)())
