"""Write a file so that readers see either the old file or the complete new one, never a partial one.

Only a regular file or a new path can be written so: the new file is renamed over the path, so a FIFO
or a device there (``/dev/null``, ``/dev/full``, a named pipe a reader waits on) would be replaced by
a regular file and its reader would get nothing. Such a target is refused before anything is written
(:func:`check_output_target`), and a write that fails at its flush, fsync or rename (a full disk) is
reported naming the path; both as :class:`AtomicWriteError`, an ``OSError``, which the scripts'
one-line error handlers (``megamoe.cli.launch.run_script``, ``megamoe-convert``) print as such.
"""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

__all__ = ["AtomicWriteError", "atomic_write", "check_output_target"]

# What a path that is not a regular file is, for the error message (os.stat's file-type tests).
_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


class AtomicWriteError(OSError):
    """``path`` cannot be written atomically (not a regular file or a new path), or its write failed
    (nothing was replaced). The message names the path; ``path`` holds it."""

    def __init__(self, path: str | os.PathLike, message: str):
        super().__init__(message)
        self.path = Path(path)


def check_output_target(path: str | os.PathLike) -> None:
    """Raise :class:`AtomicWriteError` unless ``path`` is a regular file or does not exist yet (a link
    is judged by what it points to). Callers run it among their argument checks, before any work."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "not a regular file")
    raise AtomicWriteError(path, f"{path} is {kind}: the output is written to a new file renamed over the path, "
                                 "which would replace it (a reader of a pipe or device gets nothing); name a "
                                 "regular file or a new path")


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Yield a file open on a temporary name next to ``path``; on a clean exit it is flushed, fsynced
    and renamed over ``path``; on an exception it is deleted and ``path`` is left untouched.

    ``path`` must be a regular file or a new path (:func:`check_output_target`, checked before the
    temporary file is made); a failing flush, fsync or rename raises :class:`AtomicWriteError` naming
    ``path`` (exceptions of the ``with`` body propagate as they are).

    The temporary file lives in the destination directory because a rename is only atomic within one
    filesystem. ``mode`` is ``"wb"`` or ``"w"`` (text, UTF-8). The file gets the permissions a plain
    ``open(path, "w")`` would leave: an existing ``path``'s, else ``0o666`` less the umask (a temporary
    file is created ``0o600``, which would hide checkpoints from the rest of a team's group).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    check_output_target(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, _permissions_of_a_plain_write(path))
        with os.fdopen(handle, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as file:
            yield file
            _finish(path, lambda: (file.flush(), os.fsync(file.fileno())))
        check_output_target(path)          # again: it may have been replaced while the body wrote
        _finish(path, lambda: os.replace(temporary, path))
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _finish(path: Path, step) -> None:
    """Run a flush / fsync / rename step of writing ``path``: its OSError (a full disk, a quota, an I/O
    error) as an AtomicWriteError naming ``path``."""
    try:
        step()
    except OSError as e:
        raise AtomicWriteError(path, f"writing {path} failed: {e.strerror or e}; {path} was left untouched") from e


def _permissions_of_a_plain_write(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0o022)     # reading the umask means setting it; put it straight back
        os.umask(umask)
        return 0o666 & ~umask
