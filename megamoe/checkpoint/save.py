"""Saving a megamoe checkpoint (:mod:`megamoe.checkpoint.format`): the collective, atomic
:func:`save_checkpoint` and its planning (who writes which chunk) and writing helpers.
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import math
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.checkpoint import checksums
from megamoe.checkpoint.chunk_regions import _check_tiling
from megamoe.checkpoint.errors import CheckpointError
from megamoe.checkpoint.manifest import (_DTYPES, _OLD_SUFFIX, FORMAT_NAME, FORMAT_VERSION, MANIFEST_FIELDS,
                                         MANIFEST_FILE)
from megamoe.checkpoint.manifest_digest import write_manifest
from megamoe.checkpoint_state import LogicalChunk
from megamoe.host_staging import host_buffer

logger = logging.getLogger(__name__)

DEFAULT_MAX_FILE_BYTES = 2 * 1024**3
_TMP_INFIX = ".tmp-"


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype, what: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"{what}: dtype {dtype} cannot be stored in safetensors; use one of {sorted(_DTYPES)}")
    return name


def _chunk_key(name: str, offsets: Iterable[int]) -> str:
    return f"{name}@{','.join(str(o) for o in offsets)}"


def fsync_dir(path: str) -> None:
    """Force a directory's entries (renames, new files) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    hasher = checksums.new_hasher()
    hasher.update(data.numpy())
    return hasher.hexdigest()


def _json_normalized(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serialisable: {e}") from e


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _ChunkMeta:
    """What a rank tells the others about one local chunk (no data)."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str

    @property
    def key(self) -> tuple:
        return self.name, self.offsets, self.shape


@dataclass
class _RankReport:
    """A rank's files after writing: name -> checksum entry; where each stored key went; and, with
    replica verification, a digest of every replicated chunk it holds."""

    files: dict[str, dict] = field(default_factory=dict)
    file_of_key: dict[str, str] = field(default_factory=dict)
    digests: dict[tuple, list[str]] = field(default_factory=dict)


# What to do about a file the save could not write, by errno (the rest: the reason alone).
_WRITE_FIXES = {errno.ENOSPC: "free space on that disk or save elsewhere",
                errno.EDQUOT: "free space within your disk quota or save elsewhere",
                errno.EROFS: "make that directory writable or save elsewhere",
                errno.EACCES: "make that directory writable or save elsewhere",
                errno.EPERM: "make that directory writable or save elsewhere"}
# safetensors reports its I/O errors as text: '... I/O error: <reason> (os error <errno>) at path "<file>"'.
_SAFETENSORS_IO_ERROR = re.compile(r"\(os error (\d+)\)")


def _failure_text(e: Exception) -> str:
    """One rank's failure as its line of the save's error: a file that could not be written is named, with
    the fix; anything else as the exception says."""
    if not isinstance(e, OSError) or e.errno is None:
        return f"{type(e).__name__}: {e}"
    fix = _WRITE_FIXES.get(e.errno)
    return (f"cannot write {e.filename}" if e.filename else "a write failed") + f": {os.strerror(e.errno)}" + \
        (f" ({fix})" if fix else "")


def _save_safetensors(tensors: dict[str, torch.Tensor], file_path: str) -> None:
    """``safetensors.torch.save_file``, its I/O errors (text) raised as the OSError they report, naming
    ``file_path`` (theirs name the temporary file next to it)."""
    try:
        safetensors.torch.save_file(tensors, file_path)
    except SafetensorError as e:
        match = _SAFETENSORS_IO_ERROR.search(str(e))
        if match is None:
            raise
        raise OSError(int(match[1]), os.strerror(int(match[1])), file_path) from e


def _all_ranks_or_raise(stage: str, fn: Callable[[], Any], group: ProcessGroup | None, path: str) -> list[Any]:
    """Run ``fn`` on every rank and exchange the results; if it failed anywhere, raise on every rank
    (so no rank is left waiting in a later collective), naming ``path``, the checkpoint not written."""
    local_error = None
    try:
        payload = (True, fn())
    except Exception as e:  # noqa: BLE001 - reported to every rank below, re-raised with its cause
        local_error = e
        payload = (False, _failure_text(e))
    results = comms.all_gather_object(payload, group)
    failures = [f"rank {rank}: {value}" for rank, (ok, value) in enumerate(results) if not ok]
    if failures:
        raise CheckpointError(f"checkpoint save failed while {stage}: " + "; ".join(failures) +
                              f"; {path} was not written (what it held before, and every other checkpoint, "
                              "is untouched)") from local_error
    return [value for _, value in results]


def _prepare_directory(path: str) -> str:
    """Rank 0, before a save: settle what an interrupted save left behind, create the temp directory."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    old = path + _OLD_SUFFIX
    if not os.path.isfile(os.path.join(path, MANIFEST_FILE)):
        if os.path.exists(path):
            raise ValueError(f"{path} exists and is not a megamoe checkpoint (no {MANIFEST_FILE}); refusing to "
                             "replace it")
        if os.path.isfile(os.path.join(old, MANIFEST_FILE)):
            logger.warning("restoring %s from %s, left by a save interrupted between its renames", path, old)
            os.rename(old, path)
    if os.path.exists(old):
        shutil.rmtree(old)
    for leftover in glob.glob(glob.escape(path) + _TMP_INFIX + "*"):
        logger.warning("deleting %s, left by an interrupted save", leftover)
        shutil.rmtree(leftover)
    tmp_dir = f"{path}{_TMP_INFIX}{secrets.token_hex(6)}"
    os.makedirs(tmp_dir)
    return tmp_dir


def _plan(metas_by_rank: list[list[_ChunkMeta]]) -> tuple[dict[tuple, int], dict[tuple, int], dict[str, dict]]:
    """Who writes what: the writer (lowest holding rank) and number of holders of each logical chunk,
    and each logical tensor's dtype, global shape and distinct chunks, checked for consistency."""
    writer: dict[tuple, int] = {}
    holders: dict[tuple, int] = {}
    tensors: dict[str, dict] = {}
    for rank, metas in enumerate(metas_by_rank):
        for m in metas:
            t = tensors.setdefault(m.name, {"dtype": m.dtype, "global_shape": m.global_shape, "regions": [],
                                            "first_rank": rank})
            if (t["dtype"], t["global_shape"]) != (m.dtype, m.global_shape):
                raise CheckpointError(
                    f"logical tensor {m.name!r}: rank {t['first_rank']} holds it as {t['dtype']} of global shape "
                    f"{t['global_shape']}, rank {rank} as {m.dtype} of global shape {m.global_shape}")
            if not math.prod(m.shape):
                continue  # nothing to store; an empty logical tensor is described by its entry alone
            holders[m.key] = holders.get(m.key, 0) + 1
            if m.key not in writer:
                writer[m.key] = rank
                t["regions"].append((m.offsets, m.shape))
    for name, t in tensors.items():
        _check_tiling(name, t["global_shape"], t["regions"], "the chunks held")
    return writer, holders, tensors


def _write_rank_files(tmp_dir: str, rank: int, chunks: list[LogicalChunk], writer: dict[tuple, int],
                      holders: dict[tuple, int], rank_state: dict[str, torch.Tensor], max_file_bytes: int,
                      verify_replicas: bool) -> _RankReport:
    report = _RankReport()
    to_write = [(f"rank_state/{rank}/{key}", t) for key, t in sorted(rank_state.items())]
    claimed: set[str] = set()
    for c in chunks:
        key = (c.name, c.offsets, c.shape)
        if key not in writer:
            continue  # an empty chunk
        if verify_replicas and holders[key] > 1:
            report.digests.setdefault(key, []).append(_tensor_digest(c.tensor))
        stored_key = _chunk_key(c.name, c.offsets)
        if writer[key] == rank and stored_key not in claimed:
            claimed.add(stored_key)
            to_write.append((stored_key, c.tensor))

    batches: list[list[tuple[str, torch.Tensor]]] = [[]]
    batch_bytes = 0
    for key, t in to_write:
        nbytes = t.numel() * t.element_size()
        if batches[-1] and batch_bytes + nbytes > max_file_bytes:
            batches.append([])
            batch_bytes = 0
        batches[-1].append((key, t))
        batch_bytes += nbytes
    for index, batch in enumerate(b for b in batches if b):
        file_name = f"rank{rank:05d}-{index:04d}.safetensors"
        file_path = os.path.join(tmp_dir, file_name)
        # Private host copies: safetensors refuses tensors that share memory (views of one parameter).
        _save_safetensors({key: host_buffer(t.shape, t.dtype).copy_(t.detach()) for key, t in batch}, file_path)
        report.files[file_name] = checksums.file_entry(file_path, fsync=True)
        report.file_of_key.update((key, file_name) for key, _ in batch)
    return report


def _check_replicas(reports: list[_RankReport]) -> None:
    seen: dict[tuple, tuple[int, str]] = {}
    for rank, report in enumerate(reports):
        for key, digests in report.digests.items():
            for digest in digests:
                first = seen.setdefault(key, (rank, digest))
                if first[1] != digest:
                    name, offsets, shape = key
                    raise CheckpointError(
                        f"replicas of logical tensor {name!r} (offsets {offsets}, shape {shape}) differ: rank "
                        f"{first[0]} and rank {rank} hold different values")


def _merge_fields(fields_by_rank: list[dict[str, dict]]) -> dict[str, dict]:
    merged: dict[str, dict] = {f: {} for f in MANIFEST_FIELDS}
    origin: dict[tuple[str, str], int] = {}
    for rank, fields in enumerate(fields_by_rank):
        for f, values in fields.items():
            for key, value in values.items():
                if key in merged[f] and merged[f][key] != value:
                    raise CheckpointError(f"manifest field {f}[{key!r}] differs between rank {origin[f, key]} "
                                          f"({merged[f][key]!r}) and rank {rank} ({value!r})")
                merged[f][key] = value
                origin.setdefault((f, key), rank)
    return merged


def _write_manifest(tmp_dir: str, manifest: dict) -> None:
    write_manifest(os.path.join(tmp_dir, MANIFEST_FILE), manifest)
    fsync_dir(tmp_dir)


def _swap_into_place(tmp_dir: str, path: str) -> None:
    old = path + _OLD_SUFFIX
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp_dir, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if os.path.exists(old):
        shutil.rmtree(old)


def save_checkpoint(path: str | os.PathLike, chunks: Iterable[LogicalChunk], *, group: ProcessGroup | None = None,
                    manifest_fields: dict[str, dict], rank_state: dict[str, torch.Tensor] | None = None,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, verify_replicas: bool = False,
                    extra_files: dict[str, bytes] | None = None) -> None:
    """Write ``chunks`` (this rank's logical chunks) as the checkpoint directory ``path``, atomically.

    Collective over ``group`` (``None``: this process alone); every rank passes its own chunks and the
    same ``path``. ``manifest_fields`` holds JSON dicts for some of :data:`MANIFEST_FIELDS`; ranks may
    give different keys (e.g. the placement of the MoE layers of their pipeline stage). ``rank_state``
    (e.g. RNG states as uint8 tensors) is stored per rank, see :func:`load_rank_state`. Files hold at
    most ``max_file_bytes`` of tensor data (one larger chunk gets a file of its own).
    ``verify_replicas``: fail if copies of one logical chunk on several ranks/slots differ bitwise.
    ``extra_files`` (rank 0's): relative path inside the checkpoint -> bytes, written with the rest
    (e.g. the HuggingFace side files under ``hf_files/`` that export needs).

    Raises :class:`CheckpointError` on every rank if any rank fails; ``path`` then still holds the
    previous checkpoint.
    """
    path = os.path.normpath(os.fspath(path))
    rank, world = comms.group_rank(group), comms.group_size(group)
    chunks = list(chunks)
    rank_state = dict(rank_state or {})
    if max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes must be positive, got {max_file_bytes}")
    extra_files = dict(extra_files or {})
    for name in extra_files:
        parts = name.replace("\\", "/").split("/")
        if os.path.isabs(name) or ".." in parts or name in ("", MANIFEST_FILE) or name.endswith(".safetensors"):
            raise ValueError(f"extra_files key {name!r} must be a relative path inside the checkpoint (no '..', "
                             f"not {MANIFEST_FILE} or a .safetensors file)")
    tmp_dir = None

    def describe():
        nonlocal tmp_dir
        unknown = set(manifest_fields) - set(MANIFEST_FIELDS)
        if unknown:
            raise ValueError(f"unknown manifest_fields {sorted(unknown)}; allowed: {MANIFEST_FIELDS}")
        fields = {}
        for f, value in manifest_fields.items():
            if not isinstance(value, dict):
                raise ValueError(f"manifest_fields[{f!r}] must be a dict, got {type(value).__name__}")
            fields[f] = _json_normalized(value, f"manifest_fields[{f!r}]")
        metas = [_ChunkMeta(c.name, c.offsets, c.shape, c.global_shape, _dtype_name(c.tensor.dtype, c.name))
                 for c in chunks]
        state_meta = {key: (_dtype_name(t.dtype, f"rank_state[{key!r}]"), tuple(t.shape))
                      for key, t in rank_state.items()}
        if rank == 0:
            tmp_dir = _prepare_directory(path)
        return fields, metas, state_meta, tmp_dir

    try:
        described = _all_ranks_or_raise("exchanging metadata", describe, group, path)
        tmp_dir = described[0][3]
        fields = _merge_fields([d[0] for d in described])
        writer, holders, tensors = _plan([d[1] for d in described])
        reports: list[_RankReport] = _all_ranks_or_raise(
            "writing files",
            lambda: _write_rank_files(tmp_dir, rank, chunks, writer, holders, rank_state, max_file_bytes,
                                      verify_replicas),
            group, path)
        _check_replicas(reports)

        def commit():
            if rank != 0:
                return None
            file_of_key = {k: f for r in reports for k, f in r.file_of_key.items()}
            manifest = {
                "format": FORMAT_NAME, "format_version": FORMAT_VERSION, **fields, "world_size": world,
                "tensors": {name: {
                    "dtype": t["dtype"], "global_shape": list(t["global_shape"]),
                    "chunks": [{"file": file_of_key[_chunk_key(name, offsets)], "key": _chunk_key(name, offsets),
                                "offsets": list(offsets), "shape": list(shape)} for offsets, shape in t["regions"]],
                } for name, t in sorted(tensors.items())},
                "rank_state": {str(r): {key: {"file": file_of_key[f"rank_state/{r}/{key}"],
                                              "key": f"rank_state/{r}/{key}", "dtype": dtype, "shape": list(shape)}
                                        for key, (dtype, shape) in sorted(d[2].items())}
                               for r, d in enumerate(described) if d[2]},
                "files": {name: info for r in reports for name, info in sorted(r.files.items())},
            }
            for name, data in sorted(extra_files.items()):
                target = os.path.join(tmp_dir, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            _write_manifest(tmp_dir, manifest)
            _swap_into_place(tmp_dir, path)
            logger.info("saved checkpoint %s: %d logical tensors, %d files, %.1f MiB", path, len(tensors),
                        len(manifest["files"]), sum(f["bytes"] for f in manifest["files"].values()) / 2**20)
            return None

        _all_ranks_or_raise("committing", commit, group, path)
    except Exception:
        if rank == 0 and tmp_dir is not None and os.path.exists(tmp_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise

