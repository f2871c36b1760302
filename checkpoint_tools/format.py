"""The megamoe checkpoint format: one directory holding a JSON manifest and safetensors files.

Training checkpoints and the HuggingFace converter both read and write this format; nothing is pickled.

Layout
------
::

    <path>/manifest.json
    <path>/rank00000-0000.safetensors      # what rank 0 wrote, split into files of at most max_file_bytes
    <path>/rank00001-0000.safetensors
    ...

``manifest.json``::

    format, format_version            "megamoe-checkpoint", 2 (version 1, which recorded SHA-256s, reads too)
    model_config, parallel_layout,    the caller's JSON dicts (merged over ranks: a key given by several
    expert_placement, extra           ranks must have the same value everywhere)
    world_size                        ranks that saved
    tensors      {logical name: {dtype, global_shape, chunks: [{file, key, offsets, shape}]}}
    rank_state   {"<rank>": {key: {file, key, dtype, shape}}}   per-rank state (RNG states as uint8 ...)
    files        {file name: {bytes, xxh3_128}}   (see checkpoint_tools.checksums)

The stored chunks of one logical tensor never overlap and cover it exactly (checked on save and on read),
so any region can be assembled from them whatever layout it was saved under.

Saving (collective over ``group``)
----------------------------------
Ranks exchange chunk metadata (never data). A logical chunk (name, offsets, shape) held by several ranks
(parameters replicated over DP, expert replicas) is written once, by the lowest rank holding it; with
``verify_replicas`` every holder hashes its copy first and a difference fails the save. Each rank writes
its own files; rank 0 writes the manifest last.

Atomicity and leftovers
-----------------------
Everything is written under ``<path>.tmp-<random>`` (the name chosen by rank 0 and shared with the
metadata exchange) and fsynced; once every rank has reported its files, rank 0 writes and fsyncs the
manifest, renames the current checkpoint to ``<path>.old``, renames the temporary directory to ``<path>``
and deletes ``<path>.old``. A crash therefore leaves, at worst:

- ``<path>.tmp-*`` directories: never read; the next save deletes them.
- ``<path>.old`` next to a complete ``<path>`` (crash before the deletion): the next save deletes it.
- ``<path>.old`` and no ``<path>`` (crash between the two renames): loading falls back to ``<path>.old``
  (the previous complete checkpoint, with a warning) and the next save renames it back first.

A directory at ``<path>`` without a manifest is never replaced nor deleted. Concurrent saves to one path
are not supported.

Loading
-------
Each requested chunk is assembled from the stored chunks it intersects, reading only those slices through
``safe_open(...).get_slice(key)[...]``; replicas requested twice are read once. Stored dtypes are converted
explicitly to the destination's dtype (a bf16 checkpoint loads into fp32 parameters).

Integrity (:mod:`checkpoint_tools.integrity`). A manifest is untrusted input: every file name it gives
must be a plain relative name resolving inside the checkpoint (:mod:`checkpoint_tools.safe_names`), or
reading the manifest fails before any file is opened. Every load path checks each file it reads against
the manifest before using its bytes: its size always, its checksum unless the caller opts out
(``verify_checksums=False``; the CLI's ``--no-verify-checksums``). A file is hashed once per process
(remembered by path, size, mtime, inode and recorded digest; a changed file is hashed again). A
damaged file is a :class:`CheckpointError` naming the file and the expected and actual checksums.

Several ranks loading together: without a process group each rank hashes the files it reads (no
communication); with one (``load_checkpoint(..., group=)``, ``load_training_checkpoint(world_group=)``,
``build_model_from_checkpoint(world_group=)``) the ranks exchange the names of the files they will read
and each file is hashed by exactly one rank (the bytes spread evenly), then the verdicts are exchanged and
every rank raises the same error if any file failed. Like saving (rank 0 renames the directory holding
every rank's files), this assumes all ranks see one shared filesystem.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import secrets
import shutil
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import safetensors.torch
import torch
from safetensors import safe_open
from torch.distributed import ProcessGroup

from checkpoint_tools import checksums, integrity
from checkpoint_tools.errors import CheckpointError
from checkpoint_tools.integrity import check_stored_file
from checkpoint_tools.manifest_fields import HF_FILES_DIR
from checkpoint_tools.safe_names import resolve_inside
from megamoe import comms
from megamoe.checkpoint_state import LogicalChunk

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_FILE", "MANIFEST_FIELDS", "DEFAULT_MAX_FILE_BYTES",
    "CheckpointError", "save_checkpoint", "load_checkpoint", "load_rank_state", "read_manifest",
    "verify_checkpoint", "iter_logical_tensors", "resolve_checkpoint", "check_stored_file", "planned_files",
    "fsync_dir",
]

logger = logging.getLogger(__name__)

FORMAT_NAME = "megamoe-checkpoint"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, FORMAT_VERSION)      # version 1 differs only in recording SHA-256 checksums
MANIFEST_FILE = "manifest.json"
MANIFEST_FIELDS = ("model_config", "parallel_layout", "expert_placement", "extra")
DEFAULT_MAX_FILE_BYTES = 2 * 1024**3
_OLD_SUFFIX = ".old"
_TMP_INFIX = ".tmp-"

# dtypes safetensors stores, by the name the manifest uses.
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------
Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def _dtype_name(dtype: torch.dtype, what: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"{what}: dtype {dtype} cannot be stored in safetensors; use one of {sorted(_DTYPES)}")
    return name


def _chunk_key(name: str, offsets: Iterable[int]) -> str:
    return f"{name}@{','.join(str(o) for o in offsets)}"


def _intersection(a: Region, b: Region) -> Region | None:
    """The overlap of two regions (``None`` when empty); 0-dim regions always overlap."""
    lo = tuple(max(oa, ob) for oa, ob in zip(a[0], b[0]))
    hi = tuple(min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _slices(region: Region, origin: tuple[int, ...]) -> tuple[slice, ...]:
    """``region`` as slices into a tensor whose element 0 sits at ``origin``."""
    return tuple(slice(o - base, o - base + s) for o, s, base in zip(region[0], region[1], origin))


def _check_tiling(name: str, global_shape: tuple[int, ...], regions: list[Region], what: str) -> None:
    """The regions must not overlap and must cover the logical tensor exactly."""
    regions = [r for r in regions if math.prod(r[1])]
    for i, a in enumerate(regions):
        for b in regions[i + 1:]:
            if _intersection(a, b) is not None:
                raise CheckpointError(
                    f"{what} of logical tensor {name!r} overlap without being equal: offsets {a[0]} shape {a[1]} and "
                    f"offsets {b[0]} shape {b[1]} (the ranks disagree on its layout)")
    covered, total = sum(math.prod(r[1]) for r in regions), math.prod(global_shape)
    if covered != total:
        raise CheckpointError(f"{what} of logical tensor {name!r} cover {covered} of its {total} elements "
                              f"(global shape {global_shape}): some part of it is held by no rank")


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


def _all_ranks_or_raise(stage: str, fn: Callable[[], Any], group: ProcessGroup | None) -> list[Any]:
    """Run ``fn`` on every rank and exchange the results; if it failed anywhere, raise on every rank
    (so no rank is left waiting in a later collective)."""
    local_error = None
    try:
        payload = (True, fn())
    except Exception as e:  # noqa: BLE001 - reported to every rank below, re-raised with its cause
        local_error = e
        payload = (False, f"{type(e).__name__}: {e}")
    results = comms.all_gather_object(payload, group)
    failures = [f"rank {rank}: {value}" for rank, (ok, value) in enumerate(results) if not ok]
    if failures:
        raise CheckpointError(f"checkpoint save failed while {stage}: " + "; ".join(failures)) from local_error
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
        # Private CPU copies: safetensors refuses tensors that share memory (views of one parameter).
        safetensors.torch.save_file({key: torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()) for key, t in batch},
                                    file_path)
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
    with open(os.path.join(tmp_dir, MANIFEST_FILE), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
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
        described = _all_ranks_or_raise("exchanging metadata", describe, group)
        tmp_dir = described[0][3]
        fields = _merge_fields([d[0] for d in described])
        writer, holders, tensors = _plan([d[1] for d in described])
        reports: list[_RankReport] = _all_ranks_or_raise(
            "writing files",
            lambda: _write_rank_files(tmp_dir, rank, chunks, writer, holders, rank_state, max_file_bytes,
                                      verify_replicas),
            group)
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

        _all_ranks_or_raise("committing", commit, group)
    except Exception:
        if rank == 0 and tmp_dir is not None and os.path.exists(tmp_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------
def resolve_checkpoint(path: str | os.PathLike) -> str:
    """The directory holding the checkpoint ``path`` names (``<path>.old`` after an interrupted swap)."""
    path = os.path.normpath(os.fspath(path))
    if os.path.isfile(os.path.join(path, MANIFEST_FILE)):
        return path
    old = path + _OLD_SUFFIX
    if not os.path.exists(path) and os.path.isfile(os.path.join(old, MANIFEST_FILE)):
        logger.warning("%s is missing but %s holds the previous checkpoint (a save was interrupted while "
                       "swapping directories); reading it", path, old)
        return old
    if os.path.exists(path):
        raise CheckpointError(f"{path} is not a megamoe checkpoint: it has no {MANIFEST_FILE}")
    raise CheckpointError(f"no checkpoint at {path}")


def _check_manifest_names(root: str, manifest_path: str, manifest: dict) -> None:
    """Every file name the manifest gives (its files, the chunks' and rank state's files, the HF side
    files) is a plain relative name resolving inside the checkpoint (see :mod:`checkpoint_tools.safe_names`),
    and every chunk's file is listed: refused here, before any file is opened."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{manifest_path}: 'files' must map file names to their sizes and checksums")
    for name in files:
        resolve_inside(root, name, f"{manifest_path}: files")
    stored = [(f"logical tensor {name!r}", c) for name, t in manifest["tensors"].items() for c in t["chunks"]]
    stored += [(f"rank {rank}'s state {key!r}", e) for rank, entries in manifest.get("rank_state", {}).items()
               for key, e in entries.items()]
    for what, entry in stored:
        if not isinstance(entry.get("file"), str) or entry["file"] not in files:
            raise CheckpointError(f"{manifest_path}: {what} is stored in {entry.get('file')!r}, which the manifest "
                                  "does not list among its files")
    side_dir = os.path.join(root, HF_FILES_DIR)
    for name in (manifest.get("extra") or {}).get("hf_files") or {}:
        resolve_inside(side_dir, name, f"{manifest_path}: extra.hf_files", single_component=True)


def _read_manifest_at(root: str) -> dict:
    manifest_path = os.path.join(root, MANIFEST_FILE)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {manifest_path}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{manifest_path} is not a {FORMAT_NAME} manifest")
    if manifest.get("format_version") not in _READABLE_VERSIONS:
        raise CheckpointError(f"{manifest_path}: unsupported checkpoint format version "
                              f"{manifest.get('format_version')!r}; this megamoe reads versions "
                              f"{', '.join(map(str, _READABLE_VERSIONS))}")
    for name, entry in manifest["tensors"].items():
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(f"{manifest_path}: logical tensor {name!r} has unknown dtype {entry['dtype']!r}")
        _check_tiling(name, tuple(entry["global_shape"]),
                      [(tuple(c["offsets"]), tuple(c["shape"])) for c in entry["chunks"]],
                      f"{manifest_path}: the stored chunks")
    _check_manifest_names(root, manifest_path, manifest)
    return manifest


def read_manifest(path: str | os.PathLike) -> dict:
    """The checkpoint's manifest (validated: format version, chunks tiling every tensor, every file name
    a plain name inside the checkpoint)."""
    return _read_manifest_at(resolve_checkpoint(path))


@dataclass
class _Read:
    """One slice of one stored chunk, copied into one or more destinations (replicas read once)."""

    file: str
    key: str
    stored_shape: tuple[int, ...]
    source: tuple[slice, ...]
    destinations: list[tuple[torch.Tensor, tuple[slice, ...]]]


def _plan_reads(name: str, entry: dict, region: Region, destinations: list[torch.Tensor]) -> list[_Read]:
    """The reads that fill ``destinations`` (tensors of ``region``'s shape) from the stored chunks."""
    reads, covered = [], 0
    for chunk in entry["chunks"]:
        stored: Region = (tuple(chunk["offsets"]), tuple(chunk["shape"]))
        overlap = _intersection(region, stored)
        if overlap is None or not math.prod(overlap[1]):
            continue
        covered += math.prod(overlap[1])
        target = _slices(overlap, region[0])
        reads.append(_Read(chunk["file"], chunk["key"], stored[1], _slices(overlap, stored[0]),
                           [(d, target) for d in destinations]))
    if covered != math.prod(region[1]):
        raise CheckpointError(f"logical tensor {name!r}: the stored chunks cover {covered} of the "
                              f"{math.prod(region[1])} elements requested at offsets {region[0]} shape {region[1]}")
    return reads


class _Reader:
    """Opens each needed file once (after :func:`checkpoint_tools.integrity.verified_path`: size, and
    checksum with ``verify_checksums``) and copies slices out."""

    def __init__(self, root: str, manifest: dict, verify_checksums: bool, stack: ExitStack):
        self.root, self.manifest, self.verify_checksums, self.stack = root, manifest, verify_checksums, stack
        self.handles: dict[str, Any] = {}

    def _open(self, file_name: str):
        if file_name in self.handles:
            return self.handles[file_name]
        file_path = integrity.verified_path(self.root, self.manifest, file_name,
                                            verify_checksums=self.verify_checksums)
        try:
            handle = self.stack.enter_context(safe_open(file_path, framework="pt"))
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad header
            raise CheckpointError(f"checkpoint file {file_path} is corrupt: {e}") from e
        self.handles[file_name] = handle
        return handle

    @torch.no_grad()
    def run(self, reads: list[_Read]) -> None:
        for read in sorted(reads, key=lambda r: (r.file, r.key)):
            handle = self._open(read.file)
            try:
                stored = handle.get_slice(read.key)
                if tuple(stored.get_shape()) != read.stored_shape:
                    raise CheckpointError(f"{read.file}: {read.key} has shape {tuple(stored.get_shape())}, the "
                                          f"manifest says {read.stored_shape}")
                piece = stored[read.source]
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - name the file and key whatever safetensors raised
                raise CheckpointError(f"cannot read {read.key} from {os.path.join(self.root, read.file)}: {e}") from e
            for destination, target in read.destinations:
                destination[target].copy_(piece.to(destination.dtype))


def _plan_chunk_reads(root: str, manifest: dict, chunks: Iterable[LogicalChunk],
                      strict: bool) -> tuple[list[_Read], list[str]]:
    """The reads filling ``chunks`` and the names of the requested tensors the checkpoint lacks."""
    requests: dict[tuple, list[LogicalChunk]] = {}
    for chunk in chunks:
        requests.setdefault((chunk.name, chunk.offsets, chunk.shape), []).append(chunk)
    missing: list[str] = []
    reads: list[_Read] = []
    for (name, offsets, shape), same in requests.items():
        entry = manifest["tensors"].get(name)
        if entry is None:
            missing.append(name)
            continue
        if tuple(entry["global_shape"]) != same[0].global_shape:
            raise CheckpointError(f"logical tensor {name!r} has global shape {tuple(entry['global_shape'])} in "
                                  f"{root}, the model expects {same[0].global_shape}")
        reads.extend(_plan_reads(name, entry, (offsets, shape), [c.tensor for c in same]))
    missing = sorted(set(missing))
    if missing and strict:
        shown = ", ".join(repr(n) for n in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"{len(missing)} logical tensors are missing from {root}: {shown}")
    return reads, missing


def _plan_rank_state_reads(root: str, manifest: dict, rank: int) -> tuple[dict[str, torch.Tensor], list[_Read]]:
    entries = manifest["rank_state"].get(str(rank))
    if entries is None:
        raise CheckpointError(f"{root} holds no rank state for rank {rank} (it was saved by "
                              f"{manifest['world_size']} ranks, of which {sorted(manifest['rank_state'], key=int)} "
                              "stored rank state)")
    state, reads = {}, []
    for key, e in entries.items():
        shape = tuple(e["shape"])
        state[key] = torch.empty(shape, dtype=_DTYPES[e["dtype"]])
        reads.append(_Read(e["file"], e["key"], shape, tuple(slice(0, s) for s in shape), [(state[key], ())]))
    return state, reads


def planned_files(path: str | os.PathLike, chunks: Iterable[LogicalChunk] = (), *,
                  rank_state_of: int | None = None, strict: bool = True) -> set[str]:
    """The checkpoint's files that loading ``chunks`` (and the rank state of rank ``rank_state_of``) reads:
    what a caller making several loads verifies at once (:func:`checkpoint_tools.integrity.verify_files`)."""
    root = resolve_checkpoint(path)
    manifest = _read_manifest_at(root)
    reads = _plan_chunk_reads(root, manifest, chunks, strict)[0]
    if rank_state_of is not None:
        reads += _plan_rank_state_reads(root, manifest, rank_state_of)[1]
    return {r.file for r in reads}


def load_checkpoint(path: str | os.PathLike, chunks: Iterable[LogicalChunk], *, strict: bool = True,
                    verify_checksums: bool = True, group: ProcessGroup | None = None) -> dict:
    """Fill every requested chunk in place from the checkpoint ``path``, whatever layout saved it.

    Reads only the slices the chunks need. With ``strict=False`` logical tensors absent from the
    checkpoint are skipped; their names are returned in the manifest's ``"missing_tensors"`` entry (empty
    when nothing was missing). Every file read from is first checked against the manifest: its size, and
    its checksum unless ``verify_checksums=False`` (see :mod:`checkpoint_tools.integrity`; a file this
    process verified before is not hashed again). ``group`` (every rank calling this together, e.g. the
    world group) makes that check collective: each needed file is hashed by one rank only. Without it
    each rank checks the files it reads itself and there is no communication.

    Returns the manifest. Raises :class:`CheckpointError` naming the tensor or file at fault.
    """
    root = resolve_checkpoint(path)
    manifest = _read_manifest_at(root)
    reads, missing, error = [], [], None
    try:
        reads, missing = _plan_chunk_reads(root, manifest, chunks, strict)
    except CheckpointError as e:
        error = e
    integrity.verify_files(root, manifest, {r.file for r in reads}, verify_checksums=verify_checksums, group=group,
                           local_error=error)
    with ExitStack() as stack:
        _Reader(root, manifest, verify_checksums, stack).run(reads)
    manifest["missing_tensors"] = missing
    return manifest


def load_rank_state(path: str | os.PathLike, rank: int, *, verify_checksums: bool = True) -> dict[str, torch.Tensor]:
    """The ``rank_state`` that rank ``rank`` (of the saving group) passed to :func:`save_checkpoint`; its
    files are checked as :func:`load_checkpoint` checks them."""
    root = resolve_checkpoint(path)
    manifest = _read_manifest_at(root)
    state, reads = _plan_rank_state_reads(root, manifest, rank)
    with ExitStack() as stack:
        _Reader(root, manifest, verify_checksums, stack).run(reads)
    return state


def iter_logical_tensors(path: str | os.PathLike, *,
                         verify_checksums: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(logical name, full tensor)`` in name order, one tensor in memory at a time; each file is
    checked as :func:`load_checkpoint` checks them before its first tensor is read."""
    root = resolve_checkpoint(path)
    manifest = _read_manifest_at(root)
    with ExitStack() as stack:
        reader = _Reader(root, manifest, verify_checksums, stack)
        for name, entry in manifest["tensors"].items():
            shape = tuple(entry["global_shape"])
            full = torch.empty(shape, dtype=_DTYPES[entry["dtype"]])
            reader.run(_plan_reads(name, entry, ((0,) * len(shape), shape), [full]))
            yield name, full


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check every file against the manifest: present, of the recorded size and checksum (hashed now,
    whatever this process verified before), and holding the recorded keys with the recorded shapes.
    Raises :class:`CheckpointError` listing every problem."""
    root = resolve_checkpoint(path)
    manifest = _read_manifest_at(root)
    expected: dict[str, dict[str, tuple[int, ...]]] = {name: {} for name in manifest["files"]}
    problems = []
    entries = [c for t in manifest["tensors"].values() for c in t["chunks"]]
    entries += [e for per_rank in manifest["rank_state"].values() for e in per_rank.values()]
    for e in entries:
        expected[e["file"]][e["key"]] = tuple(e["shape"])
    for file_name, info in manifest["files"].items():
        file_path = os.path.join(root, file_name)
        if not os.path.isfile(file_path):
            problems.append(f"{file_path} is missing")
            continue
        try:
            integrity.hash_and_check(file_path, info)
            with safe_open(file_path, framework="pt") as f:
                for key, shape in expected[file_name].items():
                    stored = tuple(f.get_slice(key).get_shape())
                    if stored != shape:
                        problems.append(f"{file_path}: {key} has shape {stored}, the manifest says {shape}")
        except CheckpointError as e:
            problems.append(str(e))
        except Exception as e:  # noqa: BLE001 - a corrupt header or missing key, whatever safetensors raises
            problems.append(f"{file_path} is corrupt: {e}")
    if problems:
        raise CheckpointError(f"checkpoint {root} failed verification:\n  " + "\n  ".join(problems))
