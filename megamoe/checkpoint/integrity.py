"""Checking a checkpoint's files against its manifest before their bytes are used.

Every load path (:func:`~megamoe.checkpoint.format.load_checkpoint`, ``load_rank_state``,
``iter_logical_tensors``, :class:`~megamoe.checkpoint.logical_reader.LogicalTensorReader` and what builds on
them: model building, training resumption, ``reshard``, ``export-hf``, ``verify``, generation) goes
through :func:`verified_path` or :func:`verify_files` here, the one place that decides:

- always: the file is listed in the manifest, exists and has the recorded size (a truncated file is
  refused without being hashed);
- with ``verify_checksums`` (the default everywhere; ``False`` is the explicit opt-out): its XXH3-128
  (or, for format version 1, SHA-256) matches the manifest.

A file is hashed once per process: a verified file is remembered under its real path with its size,
``st_mtime_ns``, inode, device and the recorded digest, and hashed again only when one of them changed
(the file was rewritten, or another checkpoint records another digest for it; a rewrite keeping the size
within the filesystem's timestamp granularity goes unnoticed: :func:`forget_verified` forgets every file).
Loading a training checkpoint reads model chunks, optimizer chunks and rank state in separate calls; each
file is hashed once.

Several ranks (:func:`verify_files` with a ``group``): the ranks exchange the names of the files they
will read and have not verified yet (one ``all_gather_object``), each such file is given to exactly one
rank (largest first, to the rank with the fewest bytes so far: the bytes are spread evenly), each rank
hashes its share, and the verdicts are exchanged (a second ``all_gather_object``): every rank raises
the same :class:`CheckpointError` if any file failed, else remembers every file as verified. This
assumes, as saving does (rank 0 renames the directory holding every rank's files), that all ranks see
one shared filesystem. Without a group each rank hashes the files it reads itself.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

from megamoe import comms
from megamoe.checkpoint import checksums
from megamoe.checkpoint.errors import CheckpointError

__all__ = ["check_stored_file", "verified_path", "hash_and_check", "verify_files", "forget_verified"]

logger = logging.getLogger(__name__)

# real path -> (size, mtime_ns, inode, device, algorithm, recorded digest) of a file found intact.
_verified: dict[str, tuple] = {}


def _recorded_digest(recorded: dict) -> tuple[str, str] | None:
    algorithm = next((a for a in (checksums.ALGORITHM, "sha256") if a in recorded), None)
    return None if algorithm is None else (algorithm, recorded[algorithm])


def _identity(file_path: str, recorded: dict) -> tuple:
    st = os.stat(file_path)
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, _recorded_digest(recorded))


def forget_verified() -> None:
    """Forget every file verified by this process (the next load hashes them again)."""
    _verified.clear()


def check_stored_file(root: str, manifest: dict, file_name: str) -> str:
    """The path of the checkpoint file ``file_name`` after checking that the manifest lists it, that it
    exists and that it has the recorded size (a truncated file is refused). CheckpointError otherwise."""
    file_path = os.path.join(root, file_name)
    info = manifest["files"].get(file_name)
    if info is None:
        raise CheckpointError(f"{root}: the manifest refers to {file_name}, which it does not list")
    if not os.path.isfile(file_path):
        raise CheckpointError(f"checkpoint file {file_path} is missing")
    size = os.path.getsize(file_path)
    if size != info["bytes"]:
        raise CheckpointError(f"checkpoint file {file_path} has {size} bytes, the manifest says {info['bytes']} "
                              "(truncated or overwritten)")
    return file_path


def _is_verified(file_path: str, recorded: dict) -> bool:
    return _verified.get(os.path.realpath(file_path)) == _identity(file_path, recorded)


def _remember(file_path: str, recorded: dict) -> None:
    _verified[os.path.realpath(file_path)] = _identity(file_path, recorded)


def hash_and_check(file_path: str, recorded: dict) -> None:
    """Hash ``file_path`` now (whatever was remembered) and remember it if it matches ``recorded``;
    CheckpointError naming the file and both checksums otherwise."""
    problem = checksums.check_entry(file_path, recorded)
    if problem is not None:
        _verified.pop(os.path.realpath(file_path), None)
        raise CheckpointError(problem)
    _remember(file_path, recorded)


def verified_path(root: str, manifest: dict, file_name: str, *, verify_checksums: bool = True) -> str:
    """The path of ``file_name`` once it may be read: :func:`check_stored_file`, then (with
    ``verify_checksums``) its checksum, hashed unless this process verified the unchanged file before."""
    file_path = check_stored_file(root, manifest, file_name)
    if verify_checksums:
        recorded = manifest["files"][file_name]
        if not _is_verified(file_path, recorded):
            hash_and_check(file_path, recorded)
    return file_path


def _spread(names: list[str], sizes: dict[str, int], world: int) -> list[list[str]]:
    """Each name to one rank, largest first to the rank with the fewest bytes (ties: lowest rank)."""
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += sizes[name]
    return shares


def _failure_text(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def verify_files(root: str, manifest: dict, names: Iterable[str], *, verify_checksums: bool = True,
                 group=None, local_error: BaseException | None = None) -> None:
    """Check the files ``names`` of the checkpoint at ``root`` before they are read (see the module
    docstring): sizes always, checksums with ``verify_checksums``.

    Collective over ``group`` (``None``: this process alone); each rank passes the files IT will read.
    ``local_error``: this rank failed before it could take part (e.g. while planning its reads); it is
    re-raised here, and every other rank raises a CheckpointError naming it, so that no rank is left
    waiting in a later collective.
    """
    names = sorted(set(names))
    if comms.group_size(group) == 1:
        if local_error is not None:
            raise local_error
        for name in names:
            verified_path(root, manifest, name, verify_checksums=verify_checksums)
        return
    needed: list[str] = []
    failure = None if local_error is None else _failure_text(local_error)
    if failure is None:
        try:
            for name in names:
                file_path = check_stored_file(root, manifest, name)
                if verify_checksums and not _is_verified(file_path, manifest["files"][name]):
                    needed.append(name)
        except Exception as e:  # noqa: BLE001 - reported to every rank: none may skip the exchange
            local_error, failure = e, _failure_text(e)
    requests = comms.all_gather_object((needed, failure), group)
    failures = [f"rank {rank}: {f}" for rank, (_, f) in enumerate(requests) if f is not None]
    if failures:
        if local_error is not None:
            raise local_error
        raise CheckpointError(f"loading {root} failed on another rank: " + "; ".join(failures))
    union = sorted({name for wanted, _ in requests for name in wanted})
    if not union:
        return
    share = _spread(union, {n: manifest["files"][n]["bytes"] for n in union}, comms.group_size(group))
    verdicts: dict[str, str | None] = {}
    for name in share[comms.group_rank(group)]:
        try:
            hash_and_check(os.path.join(root, name), manifest["files"][name])
            verdicts[name] = None
        except Exception as e:  # noqa: BLE001 - reported to every rank: none may skip the exchange
            verdicts[name] = _failure_text(e)
    logger.debug("verified %d of the %d files the ranks read from %s", len(verdicts), len(union), root)
    problems = sorted(p for per_rank in comms.all_gather_object(verdicts, group) for p in per_rank.values() if p)
    if problems:
        raise CheckpointError("; ".join(problems))
    for name in needed:        # verified by whichever rank hashed it: remembered here as well
        _remember(os.path.join(root, name), manifest["files"][name])
