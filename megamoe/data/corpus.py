"""A training corpus present on every machine with no download: the Python standard library's sources."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

__all__ = ["stdlib_corpus_files"]

# Test suites (and their deliberately malformed data files), third-party packages and bytecode caches.
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# Generated per build and holding that build's paths and flags: they would make the corpus differ
# between two installs of the same Python version. ("config-3.11-x86_64-linux-gnu" holds python-config.py.)
_SKIPPED_DIR_PREFIXES = ("config-",)
_SKIPPED_FILE_PREFIXES = ("_sysconfigdata",)


def stdlib_corpus_files(max_bytes: int | None = None) -> list[Path]:
    """The ``.py`` sources of this interpreter's standard library (``sysconfig.get_paths()["stdlib"]``),
    test directories, site-packages and build-generated files excluded, sorted by their path relative
    to the stdlib root (so the same Python install always gives the same list).

    Every CPython install ships these files, which makes them a corpus for demos and tests that must
    run anywhere without a download: about 12 MB of UTF-8 text for Python 3.11. With ``max_bytes``,
    the longest prefix of that list whose files total at most ``max_bytes`` bytes on disk.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for directory, subdirectories, filenames in os.walk(root):
        subdirectories[:] = [
            d for d in subdirectories if d not in _SKIPPED_DIRS and not d.startswith(_SKIPPED_DIR_PREFIXES)
        ]
        sources += [
            Path(directory, name) for name in filenames
            if name.endswith(".py") and not name.startswith(_SKIPPED_FILE_PREFIXES)
        ]
    if not sources:
        raise FileNotFoundError(f"no standard library .py sources under {root} (a bytecode-only Python install?)")
    sources.sort(key=lambda path: path.relative_to(root).parts)
    if max_bytes is None:
        return sources

    selected, total = [], 0
    for path in sources:
        total += path.stat().st_size
        if total > max_bytes:
            break
        selected.append(path)
    if not selected:
        raise ValueError(f"max_bytes={max_bytes} is smaller than the first source file {sources[0]}")
    return selected
