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
    filesystem. ``mode`` is ``"wb"`` or ``"w"`` (text, UTF-8).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
