"""Reading a megamoe checkpoint (:mod:`megamoe.checkpoint.format`): :func:`load_checkpoint` (any region of any
logical tensor, whatever layout saved it), :func:`load_rank_state`, :func:`iter_logical_tensors`,
:func:`verify_checkpoint` and :func:`planned_files`, all reading only the slices they need.
"""

from __future__ import annotations

import math
import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open
from torch.distributed import ProcessGroup

from megamoe.checkpoint import integrity
from megamoe.checkpoint.chunk_regions import Region, _intersection, _slices
from megamoe.checkpoint.errors import CheckpointError
from megamoe.checkpoint.manifest import _DTYPES, _read_manifest_at, resolve_checkpoint, stored_entries
from megamoe.checkpoint.safetensors_stream import SAFETENSORS_DTYPES
from megamoe.checkpoint_state import LogicalChunk


@dataclass
class _Read:
    """One slice of one stored chunk, copied into one or more destinations (replicas read once)."""

    file: str
    key: str
    stored_dtype: str          # the manifest's dtype name
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
        reads.append(_Read(chunk["file"], chunk["key"], entry["dtype"], stored[1], _slices(overlap, stored[0]),
                           [(d, target) for d in destinations]))
    if covered != math.prod(region[1]):
        raise CheckpointError(f"logical tensor {name!r}: the stored chunks cover {covered} of the "
                              f"{math.prod(region[1])} elements requested at offsets {region[0]} shape {region[1]}")
    return reads


def _stored_mismatch(stored, dtype: str, shape: tuple[int, ...]) -> str | None:
    """How the stored tensor ``stored`` (a safetensors slice) differs from the manifest's ``dtype`` and
    ``shape`` (None: it does not): the manifest's dtype must be the stored one, not one of another size."""
    stored_dtype, stored_shape = stored.get_dtype(), tuple(stored.get_shape())
    if stored_dtype != SAFETENSORS_DTYPES[_DTYPES[dtype]]:
        return f"is stored as {stored_dtype}, the manifest says {dtype}"
    if stored_shape != shape:
        return f"has shape {stored_shape}, the manifest says {shape}"
    return None


class _Reader:
    """Opens each needed file once (after :func:`megamoe.checkpoint.integrity.verified_path`: size, and
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
                problem = _stored_mismatch(stored, read.stored_dtype, read.stored_shape)
                if problem:
                    raise CheckpointError(f"{read.file}: {read.key} {problem}")
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
        reads.append(_Read(e["file"], e["key"], e["dtype"], shape, tuple(slice(0, s) for s in shape),
                           [(state[key], ())]))
    return state, reads


def planned_files(path: str | os.PathLike, chunks: Iterable[LogicalChunk] = (), *,
                  rank_state_of: int | None = None, strict: bool = True) -> set[str]:
    """The checkpoint's files that loading ``chunks`` (and the rank state of rank ``rank_state_of``) reads:
    what a caller making several loads verifies at once (:func:`megamoe.checkpoint.integrity.verify_files`)."""
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
    its checksum unless ``verify_checksums=False`` (see :mod:`megamoe.checkpoint.integrity`; a file this
    process verified before is not hashed again). ``group`` (every rank calling this together, e.g. the
    world group) makes that check collective: each needed file is hashed by one rank only. Without it
    each rank checks the files it reads itself and there is no communication.

    Returns the manifest. Raises :class:`CheckpointError` naming the tensor or file at fault.
    """
    # A failure on one rank only (its manifest read, its plan) is exchanged by verify_files: the other
    # ranks fail too instead of waiting for it in a later collective.
    root, manifest, reads, missing, error = os.path.normpath(os.fspath(path)), None, [], [], None
    try:
        root = resolve_checkpoint(path)
        manifest = _read_manifest_at(root)
        reads, missing = _plan_chunk_reads(root, manifest, chunks, strict)
    except Exception as e:  # noqa: BLE001 - re-raised by verify_files, after the other ranks heard of it
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
    expected: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {name: {} for name in manifest["files"]}
    problems = []
    for e, dtype in stored_entries(manifest):
        expected[e["file"]][e["key"]] = (dtype, tuple(e["shape"]))
    for file_name, info in manifest["files"].items():
        file_path = os.path.join(root, file_name)
        if not os.path.isfile(file_path):
            problems.append(f"{file_path} is missing")
            continue
        try:
            integrity.hash_and_check(file_path, info)
            with safe_open(file_path, framework="pt") as f:
                for key, (dtype, shape) in expected[file_name].items():
                    problem = _stored_mismatch(f.get_slice(key), dtype, shape)
                    if problem:
                        problems.append(f"{file_path}: {key} {problem}")
        except CheckpointError as e:
            problems.append(str(e))
        except Exception as e:  # noqa: BLE001 - a corrupt header or missing key, whatever safetensors raises
            problems.append(f"{file_path} is corrupt: {e}")
    if problems:
        raise CheckpointError(f"checkpoint {root} failed verification:\n  " + "\n  ".join(problems))
