"""Whole logical tensors of a megamoe checkpoint, read one at a time with bounded memory.

:func:`megamoe.checkpoint.format.iter_logical_tensors` keeps every file open (mapped) for the whole
iteration, so the pages read accumulate in memory; this reader closes its files every
``window_bytes`` (see :mod:`megamoe.checkpoint.read_window`) and hands out a tensor stored as one chunk
without copying it. A writer that only needs a tensor's bytes asks for :meth:`LogicalTensorReader.extents`
instead: where they lie in the files, when the stored chunks hold them in order (the tensor is cut along
its first dimension only), so they can be copied file to file without being read at all.
"""

from __future__ import annotations

import math
import os

import torch

from megamoe.checkpoint import integrity
from megamoe.checkpoint.errors import CheckpointError
from megamoe.checkpoint.manifest import _DTYPES, read_manifest, resolve_checkpoint
from megamoe.checkpoint.read_window import DEFAULT_WINDOW_BYTES, ReadWindow
from megamoe.checkpoint.safetensors_stream import SAFETENSORS_DTYPES, FileExtent, read_data_extents
from megamoe.checkpoint.scratch import ScratchBuffer

__all__ = ["LogicalTensorReader"]


class LogicalTensorReader:
    """``read(name)`` -> the full logical tensor, as stored (dtype of the manifest), valid until the next
    ``read`` (a tensor stored in several chunks is assembled in a reused buffer). Each file is checked
    against the manifest before its first byte is used: its size, and its checksum unless
    ``verify_checksums=False`` (hashed once per process, see :mod:`megamoe.checkpoint.integrity`: the
    window's reopenings cost a ``stat``). Use as a context manager."""

    def __init__(self, path: str | os.PathLike, manifest: dict | None = None, *,
                 window_bytes: int = DEFAULT_WINDOW_BYTES, verify_checksums: bool = True):
        self.verify_checksums = verify_checksums
        self.manifest = manifest if manifest is not None else read_manifest(path)
        self.root = resolve_checkpoint(path)      # <path>.old after an interrupted swap, as read_manifest
        self._window = ReadWindow(budget_bytes=window_bytes, on_open=self._check_file, open_error=self._corrupt)
        self._scratch = ScratchBuffer()
        self._headers: dict[str, dict] = {}      # file path -> its tensors' dtype, shape and bytes (checked)

    def _check_file(self, file_path: str) -> None:
        integrity.verified_path(self.root, self.manifest, os.path.relpath(file_path, self.root),
                                verify_checksums=self.verify_checksums)

    @staticmethod
    def _corrupt(file_path: str, error: Exception) -> CheckpointError:
        return CheckpointError(f"checkpoint file {file_path} is corrupt: {error}")

    def _stored(self, chunk: dict, dtype: torch.dtype) -> torch.Tensor:
        file_path = os.path.join(self.root, chunk["file"])
        handle = self._window.handle(file_path)
        try:
            piece = handle.get_tensor(chunk["key"])
        except Exception as e:  # noqa: BLE001 - name the file and key whatever safetensors raised
            raise CheckpointError(f"cannot read {chunk['key']} from {file_path}: {e}") from e
        if tuple(piece.shape) != tuple(chunk["shape"]) or piece.dtype != dtype:
            raise CheckpointError(f"{file_path}: {chunk['key']} is {piece.dtype} {tuple(piece.shape)}, the manifest "
                                  f"says {dtype} {tuple(chunk['shape'])}")
        self._window.account(piece.numel() * piece.element_size())
        return piece

    def _header(self, file_path: str) -> dict:
        header = self._headers.get(file_path)
        if header is None:
            self._check_file(file_path)
            try:
                header = self._headers[file_path] = read_data_extents(file_path)
            except (OSError, ValueError) as e:
                raise self._corrupt(file_path, e) from None
        return header

    def extents(self, name: str) -> list[FileExtent] | None:
        """Where the bytes of logical tensor ``name`` lie, in order, when its stored chunks are cut along
        the first dimension only (else None: :meth:`read` it)."""
        entry = self.manifest["tensors"].get(name)
        if entry is None:
            raise CheckpointError(f"{self.root} holds no logical tensor {name!r}")
        shape = tuple(entry["global_shape"])
        chunks = sorted(entry["chunks"], key=lambda c: tuple(c["offsets"]))
        if any(tuple(c["offsets"][1:]) != (0,) * (len(shape) - 1) or tuple(c["shape"][1:]) != shape[1:]
               for c in chunks):
            return None
        code = SAFETENSORS_DTYPES[_DTYPES[entry["dtype"]]]
        extents = []
        for chunk in chunks:
            file_path = os.path.join(self.root, chunk["file"])
            stored = self._header(file_path).get(chunk["key"])
            if stored is None or stored[:2] != (code, tuple(chunk["shape"])):
                raise CheckpointError(f"{file_path}: {chunk['key']} is {stored[:2] if stored else 'missing'}, the "
                                      f"manifest says {entry['dtype']} {tuple(chunk['shape'])}")
            extents.append(stored[2])
        return extents

    def read(self, name: str) -> torch.Tensor:
        entry = self.manifest["tensors"].get(name)
        if entry is None:
            raise CheckpointError(f"{self.root} holds no logical tensor {name!r}")
        dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["global_shape"])
        chunks = entry["chunks"]
        if len(chunks) == 1 and tuple(chunks[0]["shape"]) == shape:
            return self._stored(chunks[0], dtype)        # one chunk holds it all: no copy
        full = self._scratch.take(shape, dtype)
        covered = 0
        for chunk in chunks:
            region = tuple(slice(o, o + s) for o, s in zip(chunk["offsets"], chunk["shape"]))
            full[region].copy_(self._stored(chunk, dtype))
            covered += math.prod(chunk["shape"])
        if covered != math.prod(shape):
            raise CheckpointError(f"logical tensor {name!r}: the stored chunks cover {covered} of {math.prod(shape)} "
                                  "elements")
        return full

    def close(self) -> None:
        self._window.close()

    def __enter__(self) -> "LogicalTensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
