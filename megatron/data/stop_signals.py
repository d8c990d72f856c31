"""SIGTERM and Ctrl-C end a preprocessing command in one line, its partial output removed.

Used by ``tools/preprocess_data.py`` and ``tools/preprocess_sft_data.py``. Their ``run`` aborts
every output builder on any exception (``MMapIndexedDatasetBuilder.abort`` removes the
``.bin.tmp-PID`` files; earlier outputs under the same names are only replaced at the final
commit), so turning the signal into an exception that unwinds through ``run`` is all a clean stop
needs. Without it SIGTERM killed the process where it stood (temporaries left behind) and Ctrl-C
printed a ``KeyboardInterrupt`` traceback. The workers ignore SIGINT and are ended by the pool
(:mod:`megatron.data.worker_pool`).

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


class Stopped(BaseException):
    """SIGTERM arrived: unwinds like ``KeyboardInterrupt`` (not caught by ``except Exception``)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# SIGTERM (kill, Slurm) and SIGHUP (the terminal or ssh session closed); Ctrl-C's SIGINT
# arrives as KeyboardInterrupt.
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_INSTALLED_BY = [None]  # the pid of the process whose block installed the handler


def _raise_stopped(signum, frame):
    if os.getpid() != _INSTALLED_BY[0]:
        # A worker forked with this handler, signalled before it set its own: the default
        # action (ended by the signal, as the pool expects), not an exception in its code.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise Stopped(signum)


@contextlib.contextmanager
def stop_in_one_line(prog: str):
    """Within this block SIGTERM and SIGHUP raise :class:`Stopped`; they or Ctrl-C reaching the
    block's end print ``PROG: stopped by SIGTERM (SIGHUP, SIGINT): no partial output is left
    ...`` on stderr and exit with 128 + the signal's number (143, 129, 130), as a shell reports a
    process the signal ended. Off the main thread (where handlers cannot be set) the signals
    keep their actions.

    Raises:
        SystemExit: after the line, status 128 + signal number.
    """
    on_main = threading.current_thread() is threading.main_thread()
    _INSTALLED_BY[0] = os.getpid()
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in _SIGNALS} if on_main else {}
    try:
        yield
    except (Stopped, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        print(f"{prog}: stopped by {signal.Signals(signum).name}: no partial output is left "
              "(earlier outputs under the same names are as they were); run it again to write "
              "the output", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
