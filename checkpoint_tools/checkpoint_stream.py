"""Writing a megamoe checkpoint (:mod:`checkpoint_tools.format`) from logical tensors arriving one by one.

:func:`checkpoint_tools.format.save_checkpoint` is the collective save of a running model whose chunks
are all in memory. A conversion instead produces whole logical tensors one at a time, in an order known
in advance; :class:`CheckpointStreamWriter` cuts each into the chunks of a :class:`LayoutPlan`, writes
them into files of at most ``max_file_bytes`` (headers planned up front, see
:mod:`checkpoint_tools.safetensors_stream`) and finally writes the same manifest ``save_checkpoint``
writes: chunk keys ``<name>@<offsets>``, per-file bytes and SHA-256, the manifest fields. Memory: the
tensor being written and one chunk, never a file.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from checkpoint_tools.format import (DEFAULT_MAX_FILE_BYTES, FORMAT_NAME, FORMAT_VERSION, MANIFEST_FIELDS,
                                     MANIFEST_FILE, _DTYPES)
from checkpoint_tools.safetensors_stream import PlannedTensor, SafetensorsStreamWriter, group_into_files
from checkpoint_tools.scratch import ScratchBuffer

__all__ = ["StreamedTensor", "CheckpointStreamWriter", "dtype_name"]

logger = logging.getLogger(__name__)

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


def _chunk_key(name: str, offsets: tuple[int, ...]) -> str:
    return f"{name}@{','.join(str(o) for o in offsets)}"


class CheckpointStreamWriter:
    """Writes the planned ``tensors`` (then ``rank_state`` tensors, ``(rank, key, tensor dtype, shape)``)
    into ``directory`` (which must exist), in order. Call :meth:`write` for each tensor, then
    :meth:`write_rank_state` for each rank-state entry, then :meth:`finish` with the manifest fields."""

    def __init__(self, directory: str, tensors: list[StreamedTensor], *,
                 rank_state: list[tuple[int, str, torch.dtype, tuple[int, ...]]] = (),
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, file_prefix: str = "part"):
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
        self._file_info: dict[str, dict] = {}
        self._scratch = ScratchBuffer()       # for chunks that are not contiguous in their tensor (dim > 0 splits)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for f in self._files for t in f)

    def _put(self, key: str, tensor: torch.Tensor) -> None:
        while self._writer is None or self._writer.next_key is None:
            self._close_file()
            self._file_index += 1
            name = self._file_names[self._file_index]
            self._writer = SafetensorsStreamWriter(os.path.join(self.directory, name), self._files[self._file_index])
        self._writer.write(key, tensor)

    def _close_file(self) -> None:
        if self._writer is not None:
            size, sha = self._writer.close()
            self._file_info[self._file_names[self._file_index]] = {"bytes": size, "sha256": sha}
            self._writer = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next planned logical tensor, whole."""
        if self._next_tensor >= len(self._tensors):
            raise ValueError(f"{name!r} is not planned: every planned tensor has been written")
        planned = self._tensors[self._next_tensor]
        if name != planned.name:
            raise ValueError(f"expected logical tensor {planned.name!r} next, got {name!r}")
        if tuple(tensor.shape) != planned.global_shape or tensor.dtype != planned.dtype:
            raise ValueError(f"logical tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, planned "
                             f"{planned.dtype} {planned.global_shape}")
        for offsets, shape in planned.regions:
            if all(shape):
                chunk = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
                if not chunk.is_contiguous():
                    chunk = self._scratch.copy_of(chunk)
                self._put(_chunk_key(name, offsets), chunk)
        self._next_tensor += 1

    def write_rank_state(self, rank: int, key: str, tensor: torch.Tensor) -> None:
        self._put(f"rank_state/{rank}/{key}", tensor)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None

    def finish(self, fields: dict[str, dict], world_size: int) -> dict:
        """Close the last file and write ``manifest.json``; returns the manifest."""
        if self._next_tensor != len(self._tensors):
            raise ValueError(f"finish() with {len(self._tensors) - self._next_tensor} planned tensors unwritten")
        self._close_file()
        if len(self._file_info) != len(self._files):
            raise ValueError("finish() before every planned rank-state tensor was written")
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
            "files": dict(sorted(self._file_info.items())),
        }
        for rank, key, dtype, shape in self._rank_state:
            stored = f"rank_state/{rank}/{key}"
            manifest["rank_state"].setdefault(str(rank), {})[key] = {
                "file": self._file_of_key[stored], "key": stored, "dtype": dtype_name(dtype), "shape": list(shape)}
        path = os.path.join(self.directory, MANIFEST_FILE)
        with open(path, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        logger.info("wrote %d logical tensors in %d files (%.1f MiB)", len(self._tensors), len(self._files),
                    self.total_bytes / 2**20)
        return manifest
