"""What a path is, named in words, found with ``lstat`` / ``stat`` only: a named pipe is never opened
(opening one for reading waits for a writer forever). Used by the ``--save`` folder checks and the
HuggingFace folder checks; imports nothing of the project."""

from __future__ import annotations

import os
import stat

KINDS = ((stat.S_ISFIFO, "named pipe"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link"),
          (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"))


def file_kind(path: str) -> str:
    """What ``path`` (which exists or is a link) is, from ``lstat`` / ``stat`` only (a named pipe
    is never opened): ``named pipe``, ``folder``, ``symbolic link to nothing``, ..."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return ("symbolic link to nothing" if not os.path.exists(path)
                else "symbolic link to no regular file")
    return next((name for test, name in KINDS if test(mode)), "special file")
