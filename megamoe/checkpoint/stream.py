"""Writing a megamoe checkpoint (:mod:`megamoe.checkpoint.format`) from logical tensors arriving one by one.

:func:`megamoe.checkpoint.format.save_checkpoint` is the collective save of a running model whose chunks
are all in memory. A conversion instead produces whole logical tensors one at a time, in an order known
in advance; :class:`CheckpointStreamWriter` cuts each into the chunks of a :class:`LayoutPlan`, writes
them into files of at most ``max_file_bytes`` (headers planned up front, see
:mod:`megamoe.checkpoint.safetensors_stream`) and finally writes the same manifest ``save_checkpoint``
writes: chunk keys ``<name>@<offsets>``, per-file bytes and checksums, the manifest fields. Memory: the
tensor being written and a gathering buffer per file being written, never a file.

A tensor whose bytes lie unchanged in a file (``source``: a view of a mapped HF shard) has each of its
chunks that is one run of those bytes (a cut along the first dimension, or the whole tensor) copied
file to file (by a thread of the output file, while the next tensors are cut); chunks cut along a later
dimension are gathered and written from memory. Each file is hashed and fsynced by its own threads, a
finished one while the next is being written, so conversions write files of
:data:`CONVERSION_MAX_FILE_BYTES`: several files keep both cores busy and only the last file's fsync is
left at the end. :meth:`CheckpointStreamWriter.finish` waits for them all.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from megamoe.checkpoint.manifest import _DTYPES, FORMAT_NAME, FORMAT_VERSION, MANIFEST_FIELDS, MANIFEST_FILE
from megamoe.checkpoint.manifest_digest import write_manifest
from megamoe.checkpoint.safetensors_stream import FileExtent, PlannedTensor, SafetensorsStreamWriter, group_into_files

__all__ = ["CONVERSION_MAX_FILE_BYTES", "StreamedTensor", "CheckpointStreamWriter", "dtype_name"]

logger = logging.getLogger(__name__)

# Files a conversion writes: small enough that several are hashed at once and the fsync left after the
# last write is short, large enough to keep the file count low (4 per 2 GB).
CONVERSION_MAX_FILE_BYTES = 512 * 1024**2

Region = tuple[tuple[int, ...], tuple[int, ...]]


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of a dtype (``"bfloat16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored in a megamoe checkpoint; use one of {sorted(_DTYPES)}")
    return name


@dataclass(frozen=True)
class StreamedTensor:
    """A logical tensor to be written, and the chunks to cut it into (``regions``; ``()`` for 0-dim
    tensors is one region with empty offsets and shape)."""

    name: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    regions: tuple[Region, ...]

    @property
    def chunks_are_runs(self) -> bool:
        """Whether every chunk is one run of the tensor's bytes (cut along the first dimension only): then a
        tensor whose bytes lie in a file is written without being read."""
        whole = torch.empty(self.global_shape, dtype=self.dtype, device="meta")
        return all(whole[tuple(slice(o, o + s) for o, s in zip(offsets, shape))].is_contiguous()
                   for offsets, shape in self.regions)


def _chunk_key(name: str, offsets: tuple[int, ...]) -> str:
    return f"{name}@{','.join(str(o) for o in offsets)}"


class CheckpointStreamWriter:
    """Writes the planned ``tensors`` (then ``rank_state`` tensors, ``(rank, key, tensor dtype, shape)``)
    into ``directory`` (which must exist), in order. Call :meth:`write` for each tensor, then
    :meth:`write_rank_state` for each rank-state entry, then :meth:`finish` with the manifest fields."""

    def __init__(self, directory: str, tensors: list[StreamedTensor], *,
                 rank_state: list[tuple[int, str, torch.dtype, tuple[int, ...]]] = (),
                 max_file_bytes: int = CONVERSION_MAX_FILE_BYTES, file_prefix: str = "part"):
        self.directory = directory
        self._tensors = list(tensors)
        self._next_tensor = 0
        stored: list[PlannedTensor] = []
        for t in self._tensors:
            dtype_name(t.dtype)
            for offsets, shape in t.regions:
                if all(shape):                  # an empty chunk is described by its tensor's entry alone
                    stored.append(PlannedTensor(_chunk_key(t.name, offsets), t.dtype, shape))
        self._rank_state = [(rank, key, dtype, tuple(shape)) for rank, key, dtype, shape in rank_state]
        stored += [PlannedTensor(f"rank_state/{rank}/{key}", dtype, shape)
                   for rank, key, dtype, shape in self._rank_state]
        self._files = group_into_files(stored, max_file_bytes)
        self._file_names = [f"{file_prefix}-{i:05d}.safetensors" for i in range(len(self._files))]
        self._file_of_key = {t.key: self._file_names[i] for i, f in enumerate(self._files) for t in f}
        self._file_index = -1
        self._writer: SafetensorsStreamWriter | None = None
        self._closed_writers: list[SafetensorsStreamWriter] = []
        self._results: dict[str, Future] = {}       # file name -> its manifest entry, resolved in the background

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for f in self._files for t in f)

    def _put(self, key: str, tensor: torch.Tensor, extents: list[FileExtent] | None, stable: bool) -> None:
        while self._writer is None or self._writer.next_key is None:
            self._close_file()
            self._file_index += 1
            name = self._file_names[self._file_index]
            self._writer = SafetensorsStreamWriter(os.path.join(self.directory, name), self._files[self._file_index])
        self._writer.write(key, tensor, extents, stable=stable)

    def _close_file(self) -> None:
        if self._writer is not None:
            self._results[self._file_names[self._file_index]] = self._writer.close()
            self._closed_writers.append(self._writer)
            self._writer = None

    def write(self, name: str, tensor: torch.Tensor, source: FileExtent | None = None, *,
              stable: bool = False) -> None:
        """The next planned logical tensor, whole; ``source``: where its bytes lie unchanged in a file
        (``tensor`` must then be contiguous, and may be a meta tensor if every chunk is a run of its bytes);
        ``stable``: its memory does not change (a view of a mapped file; see
        :meth:`SafetensorsStreamWriter.write`)."""
        if self._next_tensor >= len(self._tensors):
            raise ValueError(f"{name!r} is not planned: every planned tensor has been written")
        planned = self._tensors[self._next_tensor]
        if name != planned.name:
            raise ValueError(f"expected logical tensor {planned.name!r} next, got {name!r}")
        if tuple(tensor.shape) != planned.global_shape or tensor.dtype != planned.dtype:
            raise ValueError(f"logical tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, planned "
                             f"{planned.dtype} {planned.global_shape}")
        if source is not None and not tensor.is_contiguous():
            raise ValueError(f"logical tensor {name!r}: a tensor copied from a file must be contiguous")
        for offsets, shape in planned.regions:
            if all(shape):
                chunk = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
                extents = None
                if chunk.is_contiguous() and source is not None:
                    start = source.offset + (chunk.storage_offset() - tensor.storage_offset()) * tensor.element_size()
                    extents = [FileExtent(source.path, start, chunk.numel() * chunk.element_size())]
                self._put(_chunk_key(name, offsets), chunk, extents, stable)
        self._next_tensor += 1

    def write_rank_state(self, rank: int, key: str, tensor: torch.Tensor) -> None:
        self._put(f"rank_state/{rank}/{key}", tensor, None, False)

    def abort(self) -> None:
        """Stop writing: every file is closed unfinished (the caller removes the directory)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        for writer in self._closed_writers:
            writer.abort()

    def finish(self, fields: dict[str, dict], world_size: int) -> dict:
        """Close the last file and write ``manifest.json``; returns the manifest."""
        if self._next_tensor != len(self._tensors):
            raise ValueError(f"finish() with {len(self._tensors) - self._next_tensor} planned tensors unwritten")
        self._close_file()
        if len(self._results) != len(self._files):
            raise ValueError("finish() before every planned rank-state tensor was written")
        file_info = {name: result.result() for name, result in self._results.items()}
        unknown = set(fields) - set(MANIFEST_FIELDS)
        if unknown:
            raise ValueError(f"unknown manifest fields {sorted(unknown)}")
        manifest = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            **{f: fields.get(f, {}) for f in MANIFEST_FIELDS},
            "world_size": world_size,
            "tensors": {t.name: {
                "dtype": dtype_name(t.dtype), "global_shape": list(t.global_shape),
                "chunks": [{"file": self._file_of_key[_chunk_key(t.name, offsets)], "key": _chunk_key(t.name, offsets),
                            "offsets": list(offsets), "shape": list(shape)}
                           for offsets, shape in t.regions if all(shape)],
            } for t in sorted(self._tensors, key=lambda t: t.name)},
            "rank_state": {},
            "files": dict(sorted(file_info.items())),
        }
        for rank, key, dtype, shape in self._rank_state:
            stored = f"rank_state/{rank}/{key}"
            manifest["rank_state"].setdefault(str(rank), {})[key] = {
                "file": self._file_of_key[stored], "key": stored, "dtype": dtype_name(dtype), "shape": list(shape)}
        path = os.path.join(self.directory, MANIFEST_FILE)
        write_manifest(path, manifest)
        logger.info("wrote %d logical tensors in %d files (%.1f MiB)", len(self._tensors), len(self._files),
                    self.total_bytes / 2**20)
        return manifest
