"""Convert LLaMA checkpoints between HuggingFace, NVIDIA Megatron-LM, Alibaba Megatron-LLaMA and our
Megatron layout, at any tensor/pipeline-parallel layout (Megatron-LM's
``tools/checkpoint/convert.py`` calling convention; Megatron-LM's and Megatron-LLaMA's
checkpoints are read, not written).

Usage::

    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatron \\
        --load-dir Llama-2-7b-hf --save-dir ckpt --target-tensor-parallel-size 2 \\
        --target-pipeline-parallel-size 2 [--target-params-dtype bf16]
    python tools/checkpoint/convert.py --loader hf --saver megatron --load-dir Mixtral-8x7B \
        --save-dir ckpt --target-tensor-parallel-size 2 --target-expert-parallel-size 4
    python tools/checkpoint/convert.py --loader hf --saver megatron --load-dir Mixtral-8x7B \
        --save-dir ckpt --target-tensor-parallel-size 2 --target-expert-parallel-size 2 \
        --target-expert-tensor-parallel-size 2
    python tools/checkpoint/convert.py --loader megatron --saver megatron --include-optimizer \
        --load-dir run-ep2 --save-dir run-ep4 --target-expert-parallel-size 4
    python tools/checkpoint/convert.py --loader megatron --saver hf --load-dir ckpt --save-dir out
    python tools/checkpoint/convert.py --loader megatron-llama --saver megatron \\
        --load-dir mllama-ckpt --save-dir ckpt --norm-epsilon 1e-6

A loader module ``loader_<name>.py`` provides ``add_arguments(parser)`` and
``load_checkpoint(args) -> (meta, stream)``; a saver ``saver_<name>.py`` provides
``add_arguments(parser)`` and ``save_checkpoint(meta, stream, args)``. ``meta`` holds the model's
shape under ``ModelConfig`` field names plus ``true_vocab_size``; ``stream`` yields, in order,
``("embeddings", {"word_embeddings"})``, one ``("layer", {...})`` per layer with the logical
tensors of :data:`tools.checkpoint.layout.LAYER_KEYS`, and ``("final", {"final_norm",
"output_layer" (None when tied)})``. Megatron-LM runs loader and saver as two processes joined by
a queue; here the saver pulls from the loader's generator in one process, which streams the same
way (one layer in flight) without pickling every tensor through a pipe.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import sys

if __package__ in (None, ""):  # run as a script: make `tools` and `megatron` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LOADERS = {"hf": "loader_hf", "megatron": "loader_megatron", "megatron-lm": "loader_megatron",
           "megatron-llama": "loader_megatron_llama",
           "megatron_llama": "loader_megatron_llama"}
SAVERS = {"megatron": "saver_megatron", "hf": "saver_hf"}


def _module(kind: str, name: str):
    return importlib.import_module(f"tools.checkpoint.{(LOADERS if kind == 'loader' else SAVERS)[name]}")


def loader_saver_flags_help() -> str:
    """The own flags of every loader and saver, one section each (``--help`` shows them whatever
    ``--loader`` and ``--saver`` are given)."""
    formatter = argparse.HelpFormatter("convert.py")
    for kind, table in (("loader", LOADERS), ("saver", SAVERS)):
        names = {}
        for name, module in table.items():
            names.setdefault(module, []).append(name)
        for module, aliases in names.items():
            scratch = argparse.ArgumentParser(add_help=False)
            _module(kind, aliases[0]).add_arguments(scratch)
            actions = [a for a in scratch._actions if a.option_strings]
            formatter.start_section(f"--{kind} {' / '.join(aliases)}: its own flags")
            if actions:
                formatter.add_arguments(actions)
            else:
                formatter.add_text("(none)")
            formatter.end_section()
    return formatter.format_help()


def build_parser(argv=None):
    """The parser with the general flags and those of the chosen loader and saver (with
    ``--help``: every loader's and saver's flags in the epilog). Returns
    ``(parser, loader module, saver module)``; the modules are None when not chosen (argparse
    then refuses the missing --loader / --saver)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=loader_saver_flags_help() if wants_help else None,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-type", default="GPT", choices=["GPT"],
                        help="only GPT (decoder-only LLaMA) models")
    parser.add_argument("--loader", required=True, choices=sorted(LOADERS),
                        help="format of --load-dir: hf (a Hugging Face folder), megatron / "
                             "megatron-lm (Megatron-LM's or ours), megatron-llama")
    parser.add_argument("--saver", required=True, choices=sorted(SAVERS),
                        help="format to write: megatron (ours, Megatron's layout) or hf")
    parser.add_argument("--load-dir", required=True, help="checkpoint folder to read")
    parser.add_argument("--save-dir", required=True, help="folder to write")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None,
                        help="TP of the written checkpoint (default: the source's)")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                        help="PP of the written checkpoint (default: the source's)")
    parser.add_argument("--target-expert-parallel-size", type=int, default=None,
                        help="EP of the written MoE checkpoint: each expert-parallel rank's shard "
                             "folder (mp_rank_TT[_PPP]_EEE) holds num_experts / EP experts "
                             "(default: 1)")
    parser.add_argument("--target-expert-tensor-parallel-size", type=int, default=None,
                        help="expert-TP of the written MoE checkpoint: 1 (every tensor rank's "
                             "shard holds whole experts) or the target TP (tensor rank t holds "
                             "slice t of every expert: weight1 [E/EP, 2f/TP, h], weight2 "
                             "[E/EP, h, f/TP], as training at --expert-tensor-parallel-size TP "
                             "saves them) (default: 1)")
    parser.add_argument("--target-params-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="dtype of the written weights (default: the source's)")
    parser.add_argument("--include-optimizer", action="store_true",
                        help="also convert the optimizer state (megatron loader and saver only)")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--loader", choices=sorted(LOADERS))
    pre.add_argument("--saver", choices=sorted(SAVERS))
    known, _ = pre.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    loader = _module("loader", known.loader) if known.loader else None
    saver = _module("saver", known.saver) if known.saver else None
    for module in (loader, saver):
        if module is not None:
            module.add_arguments(parser)
    return parser, loader, saver


def return_freed_memory_to_os() -> None:
    """Have glibc serve every allocation of 1 MiB or more by its own mmap, returned on free.

    By default glibc raises its mmap threshold (up to 32 MiB) after each large free, so the
    following layer-sized tensors land on the heap, whose freed space fragments and stays
    resident: converting layer after layer, the process's anonymous memory then grows by about
    half a layer per layer (measured with ``benchmarks/convert.py``). ``M_MMAP_THRESHOLD`` (-3)
    fixed at 1 MiB keeps it near one layer. Called by the command line only (it is
    process-wide); a no-op where the C library is not glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
    except (OSError, AttributeError):
        pass


def main(argv=None) -> str:
    """Run one conversion; returns the folder written.

    Raises:
        ValueError / FileNotFoundError: with the flag or file at fault (unsupported config field,
            layout that does not divide the model, missing checkpoint files).
    """
    parser, loader, saver = build_parser(argv)
    args = parser.parse_args(argv)
    for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                 "target_expert_parallel_size", "target_expert_tensor_parallel_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1 (got {value})")
    if args.include_optimizer and (args.loader, args.saver) != ("megatron", "megatron"):
        parser.error("--include-optimizer needs --loader megatron --saver megatron (only our "
                     "training checkpoints hold an optimizer state we can re-split)")
    if hasattr(saver, "check_target"):  # a --save-dir it cannot write: refused before reading
        saver.check_target(args)
    meta, stream = loader.load_checkpoint(args)
    return saver.save_checkpoint(meta, stream, args)


def command(argv=None) -> int:
    """The command line: a wrong flag or input (a missing or refused file, a layout that does not
    divide the model, a damaged checkpoint) is one line ``convert.py: error: ...`` and status 2
    (argparse's convention); anything else is a crash and keeps its traceback."""
    from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
    from megatron.usage_error import UsageError, run_command

    return run_command("convert.py", lambda a: print(f"saved {main(a)}"), argv,
                       usage_errors=(UsageError, ValueError, FileNotFoundError, FileExistsError,
                                     CheckpointError))


if __name__ == "__main__":
    return_freed_memory_to_os()
    sys.exit(command())
