"""Pieces of the reliability tests: a NullTokenizer dataset, the tiny model's flags and the child
that is killed in the middle of a save (run in a subprocess)."""

import os

import numpy as np
import torch

from megatron.checkpointing import checkpoint_folder
from megatron import checkpointing as ckpt


VOCAB = 127  # NullTokenizer: ids 0..126 and EOD 127, vocabulary 128


def write_dataset(prefix, num_docs=120, vocab=VOCAB, seed=0, max_id=None):
    """Documents of 3..30 random ids below ``max_id or vocab``, each ended by EOD (= vocab)."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    rng = np.random.RandomState(seed)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        builder.add_item(rng.randint(0, max_id or vocab, size=rng.randint(3, 31)).tolist() + [vocab])
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def tiny_argv(prefix, cache, iters=4, *extra):
    """A two-layer LLaMA on the NullTokenizer, dropout on (so RNG states matter)."""
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "5e-3", "--min-lr", "5e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--clip-grad", "1.0",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--disable-bias-linear",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
        "--untie-embeddings-and-output-weights", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "64", "--split", "90,10,0",
        "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--seed", "7",
        "--num-workers", "0", "--data-path", prefix, "--data-cache-path", cache, *extra]


def world_of_one():
    import datetime

    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.training.initialize import _free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    ps.initialize_model_parallel(1, 1)


def linear_and_adamw(value):
    """A linear layer filled with ``value`` and AdamW in Megatron's fp32 wrapper (what the
    checkpoints ask of an optimizer)."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import FP32Optimizer, OptimizerConfig

    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return [model], FP32Optimizer(torch.optim.AdamW(model.parameters(), lr=0.1),
                                  OptimizerConfig(lr=0.1), pg_collection=ps.get_process_groups())


def checkpoint_config(folder):
    from megatron.config import CheckpointConfig

    return CheckpointConfig(save=folder, load=folder, keep_last_checkpoints=1)


def crash_child(folder, function, call):
    """Save iteration 1, then die by SIGKILL at the ``call``-th call of ``function`` during the
    save of iteration 2 (run in a subprocess)."""
    import signal

    world_of_one()
    model, opt = linear_and_adamw(1.0)
    from megatron.core import parallel_state as ps

    groups = ps.get_process_groups()
    ckpt.save_checkpoint(1, model, opt, None, checkpoint_config(folder), groups, run_flags={},
                         consumed_train_samples=8, consumed_valid_samples=0)
    model, opt = linear_and_adamw(2.0)
    owner = {"torch.save": torch, "os.replace": os, "os.rename": os, "fsync_dir": checkpoint_folder}
    module, name = owner[function], function.split(".")[-1]
    real, calls = getattr(module, name), [0]

    def dying(*a, **k):
        calls[0] += 1
        if calls[0] == call:
            if function == "torch.save":  # leave half a file behind
                a[1].write(b"PK\x03\x04 half a checkpoint")
                a[1].flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)

    setattr(module, name, dying)
    ckpt.save_checkpoint(2, model, opt, None, checkpoint_config(folder), groups, run_flags={},
                         consumed_train_samples=16, consumed_valid_samples=0)



def process_running(pid):
    """Whether process ``pid`` still runs (Linux /proc; a zombie, dead but not yet reaped, does
    not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def child_processes(pid):
    """The pids of ``pid``'s child processes (Linux /proc)."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def ctrl_c_default() -> None:
    """``preexec_fn`` of a child that a test sends SIGINT: Ctrl-C's default action, as at a
    terminal. A suite run in the background (CI, ``nohup``) ignores SIGINT, and a Python child
    started from it keeps ignoring it (no KeyboardInterrupt: the tool runs to its end)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
