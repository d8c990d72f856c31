"""Guards of DataLoader worker processes (and of any helper process that must not outlive its
parent), moved here from ``megatron/training/launch.py`` so the data loader needs nothing above it.

- :func:`guard_loader_worker` (the workers' ``worker_init_fn``) makes a worker ignore SIGTERM and
  SIGINT, which a launcher sends to the rank's whole process group (torchrun on preemption, a
  Ctrl-C), so the rank finishes its iteration and saves with its loader alive; and has the
  kernel SIGKILL the worker when its rank dies, so none outlives a killed rank.
- :func:`kill_loader_workers_at_exit`: a crashed rank does not wait for its workers at exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` on Linux; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def helper_parent_pid() -> Optional[int]:
    """This process's pid, for the helpers it is about to start with the default multiprocessing
    context to pass to :func:`die_with_parent`; None under ``forkserver``, whose helpers are the
    fork server's children (the kernel's parent-death signal then follows the fork server, which
    ends with this process)."""
    import multiprocessing

    # get_context() fixes the default start method, as starting the helpers will anyway
    method = multiprocessing.get_context().get_start_method()
    return os.getpid() if method in ("fork", "spawn") else None


def die_with_parent(poll_seconds: float = 1.0, parent_pid: Optional[int] = None) -> str:
    """Have this process SIGKILLed when its parent process ends: ``prctl(PR_SET_PDEATHSIG,
    SIGKILL)`` on Linux (the signal comes when the thread that started this process exits:
    start helpers from the main thread), else a daemon thread polling ``os.getppid()`` every
    ``poll_seconds``.

    Args:
        parent_pid: the parent's pid as the parent knew it (:func:`helper_parent_pid`). A
            parent that died before the guard was set (a helper slow to start on a loaded
            machine) is then noticed too; ``os.getppid()`` read here would already be the
            orphans' reaper, and the helper lived on, blocked on a queue nobody writes (seen
            once in about 150 killed ``preprocess_data.py`` runs). None: the parent at this call.

    Returns:
        "prctl" or "poll".
    """
    parent = os.getppid() if parent_pid is None else parent_pid
    how = "prctl" if set_parent_death_signal(signal.SIGKILL) else "poll"
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "poll":
        def watch():
            while os.getppid() == parent:
                time.sleep(poll_seconds)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
    return how


def guard_loader_worker(poll_seconds: float = 1.0, parent_pid: Optional[int] = None) -> str:
    """Called first in every DataLoader worker (from its ``worker_init_fn``).

    - SIGTERM and SIGINT are ignored: torchrun forwards preemption's SIGTERM to the rank's
      process group (``os.killpg``), which holds the loader workers; a worker that died of it
      made the rank crash at its next batch, before ``--exit-signal-handler`` could save. The
      rank itself decides when to stop, and its workers end with its loader.
    - The worker dies with its rank (:func:`die_with_parent`; the loader starts its workers from
      the rank's main thread): a worker of a SIGKILLed rank otherwise lived on, blocked on a
      queue nobody reads. ``parent_pid``: the rank's pid (:func:`helper_parent_pid`).

    Returns:
        "prctl" or "poll": how the death of the rank is noticed.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return die_with_parent(poll_seconds, parent_pid)


_KILL_AT_EXIT = []  # registered once per process


def kill_loader_workers_at_exit() -> None:
    """Called in the rank when it builds a loader with workers: at interpreter exit its daemonic
    children (the loader workers) get SIGKILL before multiprocessing's own exit hook joins them.
    That hook stops daemons with SIGTERM, which :func:`guard_loader_worker` makes them ignore, so
    a rank that crashed while an iterator was alive (its traceback holds it) waited forever.
    ``atexit`` runs last-registered first; multiprocessing registers its hook when it is imported,
    before this."""
    if _KILL_AT_EXIT:
        return
    import atexit
    import multiprocessing.util  # noqa: F401 - its exit hook first, so ours runs before it

    _KILL_AT_EXIT.append(True)
    atexit.register(_kill_daemonic_children)


def _kill_daemonic_children() -> None:
    import multiprocessing

    # torch's SIGCHLD handler would report each killed worker as a crash of its own.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
