"""Opening a checkpoint for a tool that runs it where it lies (``tools/generate.py``,
``tools/serve.py``, the lm-evaluation-harness backend): the process count, the tokenizer, the
process groups at the checkpoint's TP x PP (x EP for a mixture-of-experts checkpoint) and this
rank's stage of the model, in that order, every input checked before any process group exists.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional


def tokenizer_of(args, saved: dict):
    """The run's tokenizer: ``args``' tokenizer flags (``tokenizer_type``, ``tokenizer_model``,
    ``tokenizer_name_or_path``; None: unset), else the checkpoint's recorded ``saved`` arguments.

    A NullTokenizer is rebuilt from the run's ``--vocab-size`` (``saved["vocab_size"]``, as
    pretrain_llama's checkpoints record it), not from the true vocabulary (``true_vocab_size``),
    which counts the end-of-document id the tokenizer adds: one more. A converted checkpoint
    records the true vocabulary only: ``--vocab-size`` is one less.

    Raises:
        UsageError: neither the flags nor the checkpoint name a tokenizer (a converted or
            foreign checkpoint): naming the flags to give.
    """
    from megatron.tokenizer import build_tokenizer

    tokenizer_type = getattr(args, "tokenizer_type", None) or saved.get("tokenizer_type")
    if tokenizer_type is None:
        from megatron.usage_error import UsageError
        raise UsageError(f"--load {getattr(args, 'load', None)}: the checkpoint records no "
                         "tokenizer settings (a converted or foreign checkpoint); give "
                         "--tokenizer-type with --tokenizer-model or --tokenizer-name-or-path")
    vocab_size = saved.get("vocab_size")
    if vocab_size is None and tokenizer_type == "NullTokenizer" and saved.get("true_vocab_size"):
        vocab_size = saved["true_vocab_size"] - 1
    return build_tokenizer(argparse.Namespace(
        tokenizer_type=tokenizer_type,
        tokenizer_model=getattr(args, "tokenizer_model", None) or saved.get("tokenizer_model"),
        tokenizer_name_or_path=(getattr(args, "tokenizer_name_or_path", None)
                                or saved.get("tokenizer_name_or_path")),
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


def expert_parallel_size(saved: dict) -> int:
    """The expert-parallel size a checkpoint runs at: the one it was saved at (a legacy
    checkpoint's expert shards are cut for it), 1 for a dense model."""
    if not saved.get("num_experts"):
        return 1
    return int(saved.get("expert_model_parallel_size") or 1)


def layout_error(saved: dict, load: str, world_size: int, tool: str = "tools/generate.py",
                 exact: bool = False, load_flag: str = "--load ") -> Optional[str]:
    """The message when ``world_size`` processes cannot run the checkpoint's TP x PP (x EP)
    layout (they must be a multiple of it, or equal to it when ``exact``, or with EP > 1), else
    None. ``tool`` and ``load_flag`` write the launch command it advises."""
    tp = saved.get("tensor_model_parallel_size", 1) or 1
    pp = saved.get("pipeline_model_parallel_size", 1) or 1
    ep = expert_parallel_size(saved)
    if ep > 1 and tp > 1:
        return (f"the mixture-of-experts checkpoint in --load {load} is cut for tensor-parallel "
                f"size {tp} x expert-parallel size {ep}; generation runs experts at TP > 1 only "
                f"with EP = 1 (EP > 1 needs sequence parallelism, which decoding does not use): "
                f"re-cut it with python tools/checkpoint/convert.py --loader megatron --saver "
                f"megatron --load-dir {load} --save-dir {load.rstrip('/')}_ep1 "
                f"--target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}")
    need = tp * pp * ep
    exact = exact or ep > 1
    if world_size % need == 0 and not (exact and world_size != need):
        return None
    expert = f" x expert-parallel size {ep}" if ep > 1 else ""
    return (f"the checkpoint in --load {load} is cut for tensor-parallel "
            f"size {tp} x pipeline-parallel size {pp}{expert} and needs {need} processes"
            f"{'' if exact else ' (or a multiple)'}; this run has {world_size}. Launch it with "
            f"torchrun: torchrun "
            f"--nproc-per-node {need} {tool} {load_flag}{load} ..., or reshard it for "
            f"one process first: python tools/checkpoint/convert.py --loader megatron --saver "
            f"megatron --load-dir {load} --save-dir {load.rstrip('/')}_tp1pp1 "
            "--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1")


@dataclass
class Opened:
    """A checkpoint opened by :func:`open_checkpoint`; :meth:`close` releases the groups."""

    model: object
    saved: dict
    groups: object
    tokenizer: object
    device: object
    created: bool

    @property
    def vocab_size(self) -> int:
        """The true vocabulary (padding ids are never sampled or scored)."""
        return self.saved.get("true_vocab_size") or self.tokenizer.vocab_size

    def close(self) -> None:
        from megatron.training.initialize import shutdown

        shutdown(self.created)


def open_checkpoint(load: str, tokenizer_flags=None, *, distributed_backend=None,
                    tool: str = "tools/generate.py", exact: bool = False,
                    load_flag: str = "--load ") -> Opened:
    """Check the process count and the tokenizer, start the process group (torchrun's
    environment, or a world of one), make the groups at the checkpoint's layout and load this
    rank's stage in eval mode.

    Args:
        load: the checkpoint folder (``--load``).
        tokenizer_flags: an object with ``tokenizer_type`` / ``tokenizer_model`` /
            ``tokenizer_name_or_path`` (None or missing: the checkpoint's).
        distributed_backend: ``nccl``, ``gloo`` or None (from the hardware).
        tool / load_flag: the command and its checkpoint argument in the launch advice.
        exact: the process count must equal the layout's (no data-parallel replicas).

    Raises:
        UsageError: a process count that does not fit the layout (every rank finds it alike).
        CheckpointError / FileNotFoundError / ValueError: a missing or refused checkpoint or
            tokenizer, found before any process group exists.
    """
    from megatron.core import parallel_state as ps
    from megatron.inference.model_loader import checkpoint_args, load_model_for_inference
    from megatron.training.initialize import initialize_distributed, select_device, shutdown
    from megatron.usage_error import UsageError

    saved = checkpoint_args(load)
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    error = layout_error(saved, load, world, tool=tool, exact=exact, load_flag=load_flag)
    if error:  # found by every rank alike: rank 0 says it, every rank exits 2
        raise UsageError(error)
    tokenizer = tokenizer_of(tokenizer_flags, saved)
    device = select_device(distributed_backend)
    created = initialize_distributed(distributed_backend)
    try:
        groups = ps.initialize_model_parallel(
            saved.get("tensor_model_parallel_size", 1), saved.get("pipeline_model_parallel_size", 1),
            expert_model_parallel_size=expert_parallel_size(saved))
        model, saved = load_model_for_inference(load, groups, device=device)
    except BaseException:
        shutdown(created)
        raise
    return Opened(model, saved, groups, tokenizer, device, created)
