"""Writing a safetensors file tensor by tensor, its header planned before the first byte.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once. Conversions know each
file's tensors (key, dtype, shape) in advance, so the header can be written first and each tensor's
bytes appended as soon as it exists: memory holds one tensor, never a whole file. The SHA-256 the
megamoe manifest records is computed on the bytes as they are written (in a helper thread: hashing and
writing both release the GIL), so files are never read back.

The layout is the one safetensors reads: an 8-byte little-endian header length, the JSON header
(``{key: {dtype, shape, data_offsets}}`` plus ``__metadata__``) padded with spaces to a multiple of 8,
then the tensors' bytes back to back in the planned order.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

__all__ = ["SAFETENSORS_DTYPES", "PlannedTensor", "group_into_files", "SafetensorsStreamWriter"]

if sys.byteorder != "little":       # safetensors stores little-endian; tensors are written as they lie
    raise ImportError("checkpoint_tools.safetensors_stream needs a little-endian machine")

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a file to be written."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def group_into_files(tensors: list[PlannedTensor], max_file_bytes: int) -> list[list[PlannedTensor]]:
    """Consecutive runs of ``tensors`` holding at most ``max_file_bytes`` each (a larger tensor gets a file
    of its own)."""
    files: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return [f for f in files if f]


def _header(tensors: list[PlannedTensor], metadata: dict[str, str] | None) -> bytes:
    entries: dict[str, dict] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        if t.key in entries:
            raise ValueError(f"safetensors key {t.key!r} is planned twice in one file")
        entries[t.key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _raw_bytes(tensor: torch.Tensor):
    """The tensor's bytes as a buffer (no copy for a contiguous CPU tensor); None when it has none."""
    if tensor.numel() == 0:
        return None
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


class SafetensorsStreamWriter:
    """Writes ``tensors`` to ``path`` in order: :meth:`write` each one, then :meth:`close`.

    ``write`` checks the key, dtype and shape against the plan. ``close`` fsyncs and returns
    ``(bytes, sha256 hex or None)``; closing before every tensor was written is an error. On an exception
    inside a ``with`` block the file is closed and left for the caller's cleanup.
    """

    def __init__(self, path: str | os.PathLike, tensors: list[PlannedTensor], *,
                 metadata: dict[str, str] | None = None, sha256: bool = True):
        self.path = os.fspath(path)
        self._plan = list(tensors)
        self._next = 0
        self._digest = hashlib.sha256() if sha256 else None
        self._hasher = ThreadPoolExecutor(max_workers=1) if sha256 else None
        self._file = open(self.path, "wb")
        self._bytes = 0
        self._put(_header(self._plan, metadata))

    def _put(self, data) -> None:
        pending: Future | None = None
        if self._digest is not None:
            pending = self._hasher.submit(self._digest.update, data)
        self._file.write(data)
        self._bytes += len(data) if isinstance(data, bytes) else data.nbytes
        if pending is not None:
            pending.result()

    @property
    def next_key(self) -> str | None:
        return self._plan[self._next].key if self._next < len(self._plan) else None

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._plan):
            raise ValueError(f"{self.path}: {key!r} is not planned for this file (all its tensors are written)")
        planned = self._plan[self._next]
        if key != planned.key:
            raise ValueError(f"{self.path}: expected {planned.key!r} next, got {key!r}")
        if tensor.dtype != planned.dtype or tuple(tensor.shape) != planned.shape:
            raise ValueError(f"{self.path}: {key!r} is {tensor.dtype} {tuple(tensor.shape)}, planned "
                             f"{planned.dtype} {planned.shape}")
        data = _raw_bytes(tensor)
        if data is not None:
            self._put(data)
        self._next += 1

    def close(self) -> tuple[int, str | None]:
        if self._next != len(self._plan):
            missing = [t.key for t in self._plan[self._next:]]
            self.abort()
            raise ValueError(f"{self.path}: closed with {len(missing)} planned tensors unwritten: {missing[:4]}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._shutdown()
        return self._bytes, None if self._digest is None else self._digest.hexdigest()

    def abort(self) -> None:
        """Close without completing (the caller removes the file)."""
        if not self._file.closed:
            self._file.close()
        self._shutdown()

    def _shutdown(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def __enter__(self) -> "SafetensorsStreamWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()
