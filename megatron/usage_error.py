"""Usage errors: one line, on one rank, exit status 2 (argparse's convention).

A usage error is a mistake in the command line or in what it names: a flag out of range, a file
that is not what its flag says, a ``--save`` folder another job holds, a checkpoint that cannot be
resumed as asked. The program cannot run as given and the fix is the user's, so the user gets one
line, ``PROG: error: --flag (value) ...: why; how to fix``, printed once for the whole job, and
status 2, with no stack trace of ours (a traceback helps nobody fix a flag). Genuine crashes are
not usage errors: they keep their traceback and torchrun's root-cause summary.

Who prints:

* errors found before the process groups exist (argument parsing and validation) are found by
  every rank alike, from the same flags: rank 0 prints, the others exit silently; under torchrun
  those on rank 0's node first give it :data:`RANK_0_GRACE_S` to say it (the agent stops every
  worker as soon as one has exited: a worker quicker than rank 0 took the line with it), and are
  stopped by the agent once rank 0 has exited;
* errors found later, by some ranks only (the ``--save`` folder is checked by rank 0; a shard by
  the rank that reads it), are agreed on by :func:`agree_on_usage_error`, a collective: the
  lowest rank that found one prints at once (then a barrier: the line is out before any rank
  exits and torchrun stops the rest), every rank leaves with status 2, none waits in a
  collective for a rank that has gone.

Under torchrun the agent then reports the failed workers (``exitcode: 2``) in its own summary and
exits 1 itself; a worker cannot change that.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Callable, Optional

USAGE_EXIT_STATUS = 2
# Seconds a silent rank under torchrun waits for rank 0 to say an error every rank found (the
# agent ends the wait when rank 0 exits; on a loaded node rank 0 reached the check seconds later).
RANK_0_GRACE_S = 30.0


class UsageError(ValueError):
    """A mistake in the command line or its inputs, said in one line that names the flag or file,
    the value, why and the fix.

    Args:
        message: the line (newlines are folded into spaces when printed).
        reporter: the global rank that prints it; None when every rank found it (rank 0 prints).
        silent: this rank only learned that rank ``reporter`` found one; it prints nothing.
    """

    def __init__(self, message: str, *, reporter: Optional[int] = None, silent: bool = False):
        super().__init__(message)
        self.reporter = reporter
        self.silent = silent
        self.printed = False  # said already (by agree_on_usage_error)


def one_line(message: str) -> str:
    """``message`` with every run of whitespace (newlines included) folded into one space."""
    return re.sub(r"\s+", " ", str(message)).strip()


def this_rank() -> int:
    """The global rank from the launcher's environment (``RANK``; 0 when absent)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def prints_here(error: UsageError, rank: Optional[int] = None) -> bool:
    """Whether this rank prints ``error``: not silent, and the reporter (rank 0 by default)."""
    rank = this_rank() if rank is None else rank
    if error.silent or error.printed:
        return False
    return rank == (0 if error.reporter is None else error.reporter)


def agree_on_usage_error(error: Optional[UsageError], device, group=None,
                         kind: type = UsageError) -> None:
    """Collective over ``group`` (the world when None): when any rank passes an error, every rank
    raises. One all-reduce (MIN) of an int64 elects the lowest rank with an error as the reporter.

    Args:
        error: this rank's usage error, or None.
        device: where the collective's tensor lives (the backend's device).
        kind: the class of the errors raised (a subclass of :class:`UsageError` taking the same
            arguments, e.g. one that is also a ``CheckpointError``, so callers that catch that
            class keep working).

    Raises:
        UsageError: (of class ``kind``) on the reporter, its own error (``reporter`` set to its
            rank); on every other rank a silent one naming the reporter.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    elected = torch.tensor([rank if error is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(elected, op=dist.ReduceOp.MIN, group=group)
    reporter = int(elected.item())
    if reporter == world:
        return
    global_reporter = dist.get_global_rank(group, reporter) if group is not None else reporter
    if error is not None and rank == reporter:
        agreed = kind(str(error), reporter=global_reporter)
        if _COMMAND:
            # Said now, before the others leave: torchrun stops the remaining workers as soon as
            # one has exited, which could be before this rank has unwound to run_command.
            _say(_COMMAND, agreed)
    else:
        agreed = kind(f"rank {global_reporter} found a usage error (see its line)",
                      reporter=global_reporter, silent=True)
    dist.barrier(group=group)  # every rank is here: the line is out before any rank exits
    raise agreed from error


def _rank_0_says_it(error: BaseException) -> bool:
    """Whether this rank, under torchrun on rank 0's node, leaves ``error`` to rank 0, which may
    not have printed it yet: a :class:`UsageError` found by every rank (no reporter, not agreed
    through a collective). Not a tool's other input errors, which some ranks may find alone (rank
    0 would then wait in a collective), nor on another node (rank 0's exit does not stop this
    node's agent: the wait would only delay the job)."""
    return (isinstance(error, UsageError) and error.reporter is None and not error.silent
            and not error.printed and this_rank() != 0 and "TORCHELASTIC_RUN_ID" in os.environ
            and os.environ.get("GROUP_RANK", "0") == "0")


_COMMAND: Optional[str] = None  # the command run_command runs (for agree_on_usage_error's line)


def _say(prog: str, error: BaseException) -> None:
    print(f"{prog}: error: {one_line(error)}", file=sys.stderr, flush=True)
    if isinstance(error, UsageError):
        error.printed = True


def run_command(prog: str, main: Callable, argv=None,
                usage_errors: tuple = (UsageError,)) -> int:
    """Run ``main(argv)`` as a command: an exception of ``usage_errors`` becomes one line
    ``PROG: error: ...`` on stderr (on the rank that reports it) and status 2.

    Args:
        prog: the command's name as users type it (``pretrain_llama.py``).
        main: the command's function of ``argv``.
        usage_errors: the exception classes that are the user's to fix (a tool adds the errors of
            its inputs, e.g. a malformed dataset); one that is not a :class:`UsageError` is taken
            as found by every rank alike (rank 0 prints it).

    Returns:
        0 after ``main`` returned, 2 after a usage error.
    """
    global _COMMAND
    previous, _COMMAND = _COMMAND, prog
    try:
        main(argv)
    except usage_errors as exc:
        # Another class of ``usage_errors`` is one every rank finds alike (the flags, the files
        # they name, read before any collective): rank 0 says it, as for a UsageError of no
        # reporter. A load's errors found by some ranks only arrive agreed, as UsageErrors.
        error = exc if isinstance(exc, UsageError) else UsageError(str(exc))
        if prints_here(error):
            _say(prog, exc)
        elif _rank_0_says_it(exc):
            time.sleep(RANK_0_GRACE_S)
        return USAGE_EXIT_STATUS
    finally:
        _COMMAND = previous
    return 0
