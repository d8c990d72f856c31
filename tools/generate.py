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


def tokenizer_of(args, saved: dict):
    """The run's tokenizer: this tool's tokenizer flags, else the checkpoint's ``saved`` args.

    A NullTokenizer is rebuilt from the run's ``--vocab-size`` (``saved["vocab_size"]``, as
    pretrain_llama's checkpoints record it), not from the true vocabulary (``true_vocab_size``),
    which counts the end-of-document id the tokenizer adds: one more. A converted checkpoint
    records the true vocabulary only: ``--vocab-size`` is one less.
    """
    from megatron.tokenizer import build_tokenizer

    tokenizer_type = args.tokenizer_type or saved.get("tokenizer_type")
    if tokenizer_type is None:
        from megatron.usage_error import UsageError
        raise UsageError(f"--load {args.load}: the checkpoint records no tokenizer settings (a "
                         "converted or foreign checkpoint); give --tokenizer-type with "
                         "--tokenizer-model or --tokenizer-name-or-path")
    vocab_size = saved.get("vocab_size")
    if vocab_size is None and tokenizer_type == "NullTokenizer" and saved.get("true_vocab_size"):
        vocab_size = saved["true_vocab_size"] - 1
    return build_tokenizer(argparse.Namespace(
        tokenizer_type=tokenizer_type,
        tokenizer_model=args.tokenizer_model or saved.get("tokenizer_model"),
        tokenizer_name_or_path=args.tokenizer_name_or_path or saved.get("tokenizer_name_or_path"),
        vocab_size=vocab_size))


def eod_of(tokenizer):
    """The tokenizer's end-of-document id, or None where it has none."""
    eod = getattr(tokenizer, "_eod", None)
    if eod is None:
        try:
            eod = tokenizer.eod
        except (ValueError, AttributeError, NotImplementedError):
            eod = None
    return eod


def layout_error(saved: dict, load: str, world_size: int, tool: str = "tools/generate.py",
                 exact: bool = False):
    """The message when ``world_size`` processes cannot run the checkpoint's TP x PP layout
    (they must be a multiple of it, or equal to it when ``exact``), else None."""
    tp = saved.get("tensor_model_parallel_size", 1) or 1
    pp = saved.get("pipeline_model_parallel_size", 1) or 1
    if world_size % (tp * pp) == 0 and not (exact and world_size != tp * pp):
        return None
    return (f"the checkpoint in --load {load} is cut for tensor-parallel "
            f"size {tp} x pipeline-parallel size {pp} and needs {tp * pp} processes"
            f"{'' if exact else ' (or a multiple)'}; this run has {world_size}. Launch it with "
            f"torchrun: torchrun "
            f"--nproc-per-node {tp * pp} {tool} --load {load} ..., or reshard it for "
            f"one process first: python tools/checkpoint/convert.py --loader megatron --saver "
            f"megatron --load-dir {load} --save-dir {load.rstrip('/')}_tp1pp1 "
            "--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1")


def main(argv=None) -> list:
    """Generate; returns the texts (on every rank)."""
    from megatron.core import parallel_state as ps
    from megatron.inference import generate
    from megatron.inference.model_loader import checkpoint_args, load_model_for_inference
    from megatron.training.initialize import initialize_distributed, select_device, shutdown

    args = parse_args(argv)
    saved = checkpoint_args(args.load)
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    error = layout_error(saved, args.load, world)
    if error:  # found by every rank alike: rank 0 says it, every rank exits 2
        from megatron.usage_error import UsageError
        raise UsageError(error)
    tokenizer = tokenizer_of(args, saved)
    device = select_device(args.distributed_backend)
    created = initialize_distributed(args.distributed_backend)
    try:
        groups = ps.initialize_model_parallel(saved.get("tensor_model_parallel_size", 1),
                                              saved.get("pipeline_model_parallel_size", 1))
        model, saved = load_model_for_inference(args.load, groups, device=device)
        prompts = [tokenizer.tokenize(text) for text in args.prompt]
        eod = eod_of(tokenizer)
        out = generate(model, prompts, args.max_new_tokens, greedy=args.greedy,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       vocab_size=saved.get("true_vocab_size") or tokenizer.vocab_size,
                       eod=eod, seed=args.seed, device=device, pg_collection=groups)
        texts = [tokenizer.detokenize(ids) for ids in out]
        if dist.get_rank() == 0:
            for text in texts:
                print(f"--- sample ---\n{text}", flush=True)
        return texts
    finally:
        shutdown(created)


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
