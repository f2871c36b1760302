"""An output directory that appears complete or not at all.

Everything is written into ``<path>.tmp-<random>`` next to ``path``; on success an existing ``path`` is
renamed to ``<path>.old``, the temporary directory renamed to ``path`` and the old one deleted (the
naming :mod:`megamoe.checkpoint.format` uses, so its loader falls back to ``<path>.old`` after a crash
between the two renames). On any error the temporary directory is deleted and ``path`` is untouched.
"""

from __future__ import annotations

import glob
import logging
import os
import secrets
import shutil
from typing import Callable, Iterable

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.format import fsync_dir

__all__ = ["OutputDirectory"]

logger = logging.getLogger(__name__)


def _inside(path: str, other: str) -> bool:
    """Whether ``path`` is ``other`` or lies inside it (after resolving links)."""
    path, other = os.path.realpath(path), os.path.realpath(other)
    return path == other or path.startswith(other.rstrip(os.sep) + os.sep)


def _remove(path: str) -> None:
    """Delete the directory ``path`` if it exists; a link there (left by an older version that replaced a
    linked OUT_DIR) is unlinked, never followed."""
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.exists(path):
        shutil.rmtree(path)


class OutputDirectory:
    """``with OutputDirectory(path, ...) as tmp:`` write into ``tmp``; it becomes ``path`` on success.

    Checked at construction, before any work: ``path`` must not be a symbolic link, must not exist unless
    ``overwrite``, and then must be empty or pass ``replaceable`` (e.g. "holds a manifest.json": a
    directory of something else is never deleted); ``path`` must not be or contain any of ``inputs``, nor
    lie inside one.
    """

    def __init__(self, path: str | os.PathLike, *, overwrite: bool, what: str,
                 replaceable: Callable[[str], bool], inputs: Iterable[str | os.PathLike] = ()):
        self.path = os.path.normpath(os.path.abspath(os.fspath(path)))
        for source in inputs:
            source = os.fspath(source)
            if _inside(self.path, source) or _inside(source, self.path):
                raise ConversionError(f"the output {self.path} overlaps the input {source}; choose another OUT_DIR")
        if os.path.islink(self.path):       # replacing renames the link, and its target stays where it was
            raise ConversionError(f"{self.path} is a symbolic link (to {os.path.realpath(self.path)}); refusing to "
                                  "replace it, even with --overwrite: name the directory itself as OUT_DIR, or remove "
                                  "the link")
        if os.path.lexists(self.path):
            if not overwrite:
                raise ConversionError(f"{self.path} already exists; pass --overwrite to replace it")
            if not os.path.isdir(self.path):
                raise ConversionError(f"{self.path} exists and is not a directory; refusing to replace it")
            if os.listdir(self.path) and not replaceable(self.path):
                raise ConversionError(f"{self.path} exists and is not {what}; refusing to replace it even with "
                                      "--overwrite (delete it yourself if it is not needed)")
        self.tmp: str | None = None

    def __enter__(self) -> str:
        parent = os.path.dirname(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise ConversionError(f"cannot create the parent directory of {self.path}: {e}") from None
        for leftover in glob.glob(glob.escape(self.path) + ".tmp-*"):
            logger.warning("deleting %s, left by an interrupted run", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        self.tmp = f"{self.path}.tmp-{secrets.token_hex(6)}"
        os.makedirs(self.tmp)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            fsync_dir(self.tmp)
            old = self.path + ".old"
            _remove(old)
            if os.path.exists(self.path):
                os.rename(self.path, old)
            os.rename(self.tmp, self.path)
            fsync_dir(os.path.dirname(self.path))
            _remove(old)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
