"""Write a file so that readers see either the old file or the complete new one, never a partial one."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_write"]


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Yield a file open on a temporary name next to ``path``; on a clean exit it is flushed, fsynced
    and renamed over ``path``; on an exception it is deleted and ``path`` is left untouched.

    The temporary file lives in the destination directory because a rename is only atomic within one
    filesystem. ``mode`` is ``"wb"`` or ``"w"`` (text, UTF-8). The file gets the permissions a plain
    ``open(path, "w")`` would leave: an existing ``path``'s, else ``0o666`` less the umask (a temporary
    file is created ``0o600``, which would hide checkpoints from the rest of a team's group).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, _permissions_of_a_plain_write(path))
        with os.fdopen(handle, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _permissions_of_a_plain_write(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0o022)     # reading the umask means setting it; put it straight back
        os.umask(umask)
        return 0o666 & ~umask
