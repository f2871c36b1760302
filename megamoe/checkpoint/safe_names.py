"""File names read from untrusted files (a checkpoint's manifest, a HuggingFace index), checked before
any file is opened or written under them.

Checkpoints and HF directories get shared and downloaded, so the names they list are untrusted input:
a name must be a plain relative path (no ``..`` or ``.`` component, not absolute, no backslash or NUL,
no empty component) and must resolve (symbolic links followed) inside its directory. A link leading
outside is refused, with one exception on the HF side (``extra_roots``): a HuggingFace hub cache
snapshot (``<repo>/snapshots/<revision>/``) holds links into ``<repo>/blobs/``, which is where
``from_pretrained`` reads them too. A link loop is refused as such (not as a missing file).
"""

from __future__ import annotations

import errno
import os
import stat

from megamoe.checkpoint.errors import CheckpointError

__all__ = ["check_name", "resolve_inside", "hub_cache_roots", "check_regular_file"]


def check_name(name, what: str, *, single_component: bool = False, error=CheckpointError) -> str:
    """``name`` if it is a plain relative path (one component with ``single_component``), else ``error``
    naming ``what`` and the problem. Purely lexical: no file is touched."""
    if not isinstance(name, str) or not name:
        raise error(f"{what}: {name!r} is not a file name")
    problem = None
    if "\x00" in name or "\\" in name:
        problem = "it holds a backslash or NUL character"
    elif name.startswith("/") or os.path.isabs(name):
        problem = "it is an absolute path"
    elif any(part in ("", ".", "..") for part in name.split("/")):
        problem = "it has an empty, '.' or '..' component"
    elif single_component and "/" in name:
        problem = "it names a file in a subdirectory"
    if problem is not None:
        raise error(f"{what}: refusing the file name {name!r}: {problem}; only plain relative names of files "
                    "inside the directory are accepted (the file is untrusted input)")
    return name


def hub_cache_roots(directory: str) -> tuple[str, ...]:
    """``(<repo>/blobs,)`` when ``directory`` is a HuggingFace hub cache snapshot, else ``()``. The blobs
    directory counts only as a real directory of the cache: were it a link, everything its target holds
    (``/`` itself) would pass as inside the cache."""
    real = os.path.realpath(directory)
    snapshots = os.path.dirname(real)
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    if os.path.basename(snapshots) == "snapshots" and os.path.isdir(blobs) and not os.path.islink(blobs):
        return (blobs,)
    return ()


def check_regular_file(path: str, what: str, error=CheckpointError) -> str:
    """``path`` if it is a regular file (links followed), else ``error`` naming it: a FIFO (whose opening
    blocks until a writer comes), a socket, a device or a directory is never opened. Only ``stat`` is called."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{what} {path} is missing (or a link to nothing)") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e}") from None
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a directory" if stat.S_ISDIR(mode)
                else "a special file")
        raise error(f"{what} {path} is {kind}, not a regular file; refusing to read it (replace it with the file "
                    "itself)")
    return path


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_inside(directory: str, name, what: str, *, single_component: bool = False, error=CheckpointError,
                   extra_roots: tuple[str, ...] = ()) -> str:
    """The path of ``name`` inside ``directory`` after :func:`check_name` and after checking that it resolves
    (links followed) inside ``directory`` or one of ``extra_roots``; a link loop is refused. The file need
    not exist (the caller says so if it must)."""
    check_name(name, what, single_component=single_component, error=error)
    path = os.path.join(directory, name)
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{what}: {path} is a symbolic link loop; replace it with the file itself") from None
    real = os.path.realpath(path)
    roots = (os.path.realpath(directory),) + tuple(os.path.realpath(r) for r in extra_roots)
    if not any(_inside(real, root) for root in roots):
        raise error(f"{what}: refusing {path}: it is a symbolic link leading outside {directory} (to {real}); "
                    "copy the file into the directory instead of linking to it")
    return path
