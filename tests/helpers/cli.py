"""A command's ``main(argv)`` run in this process as a shell would see it: its exit status,
stdout and stderr, without the 2-5 s of a fresh interpreter importing torch again. A test that
checks a usage error, a ``--help`` or a one-line refusal uses it; each entry point keeps one
subprocess test for the real exit status and the one-line error."""

from __future__ import annotations

import contextlib
import io
import types
from typing import Callable, Sequence


def run_main(main: Callable, argv: Sequence[str]) -> types.SimpleNamespace:
    """``main(list(argv))`` with stdout and stderr captured.

    Returns:
        ``returncode`` (``main``'s int return, 0 for None; a ``SystemExit``'s code as the
        interpreter turns it into a status: None 0, an int itself, anything else 1 with the
        value on stderr), ``stdout`` and ``stderr`` (str), like ``subprocess.run``'s result.
    """
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
            if code is not None and not isinstance(code, int):
                print(code, file=err)
                code = 1
    return types.SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=err.getvalue())
