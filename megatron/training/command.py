"""The command line of a training entry script (``pretrain_llama.py``, ``finetune_llama.py``):
what ends a run and how it is said.

- a usage error: one line on one rank, status 2 (:func:`megatron.usage_error.run_command`);
- a stop for non-finite iterations: status 1, no traceback (rank 0 logged the reason);
- a failed save (a full disk): the one agreed line, status 1; the previous checkpoint is intact;
- a data file damaged under the running job (a ``.bin`` truncated after it was opened): one line
  naming the file, status 1, from the rank that read it, also when a DataLoader worker read it
  (torch re-raises the worker's error in the rank with its traceback folded into the message);
  the last checkpoint is intact.

Anything else is a crash and keeps its traceback.
"""

from __future__ import annotations

import sys

from megatron.usage_error import one_line, run_command, this_rank

_WORKER_TRACEBACK = "Original Traceback (most recent call last):"


def data_error_line(exc: BaseException) -> str:
    """The message of a data error, without the DataLoader worker's folded traceback: torch's
    ``ExceptionWrapper`` makes it ``Caught E in DataLoader worker process N. Original Traceback
    ...: E: message``; the message is what follows the last ``E: ``."""
    text = str(exc)
    if _WORKER_TRACEBACK in text:
        tail = text.split(_WORKER_TRACEBACK, 1)[1]
        marker = f"{type(exc).__name__}: "
        if marker in tail:
            text = tail.rsplit(marker, 1)[1]
    return one_line(text)


def run_training_command(prog: str, main, argv=None) -> int:
    """``main(argv)`` under the rules of the module docstring; returns the exit status."""
    from megatron.core.dist_checkpointing.checkpoint_io import CheckpointSaveError
    from megatron.data.indexed_dataset import IndexedDatasetError
    from megatron.training.train import NonFiniteTrainingError

    try:
        return run_command(prog, main, argv)
    except NonFiniteTrainingError:
        return 1
    except CheckpointSaveError as exc:  # a full disk: the agreed line, the previous one intact
        if this_rank() == exc.reporter:
            print(f"{prog}: error: {one_line(exc)}", file=sys.stderr, flush=True)
        return 1
    except IndexedDatasetError as exc:  # damaged under the run: named by the rank that read it
        print(f"{prog}: error: {data_error_line(exc)}", file=sys.stderr, flush=True)
        return 1
