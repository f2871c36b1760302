"""Writing a safetensors file tensor by tensor, its header planned before the first byte.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once. Conversions know each
file's tensors (key, dtype, shape) in advance, so the header can be written first and each tensor's
bytes appended as soon as it exists: memory holds one tensor, never a whole file.

A tensor's bytes reach the file one of two ways: written from memory (any strides: gathered a piece
at a time), or, when they already lie in another file unchanged (an HF shard, a stored chunk;
:class:`FileExtent`), copied file to file inside the kernel (``copy_file_range``, as ``cp`` does; a
plain read and write where the file systems refuse), which never maps the source into the process.
Copies, and tensors whose memory stays as it is (views of a mapped file, a few MB of them at a time),
are left to a thread of the file while the caller goes on with the next tensors and the next files;
other tensors the caller's thread writes before going on (so it may reuse their memory). Every byte's
place in the file is known from the plan, so the two proceed independently.

Each file also has two more threads:

- one computes the checksum the megamoe manifest records (:mod:`megamoe.checkpoint.checksums`) on the bytes
  as they are in the file, read back from the page cache right behind the completed part (neither writer
  waits for the hash);
- one starts writeback every :data:`WRITEBACK_STEP` bytes (``fdatasync``) instead of all at the end, and
  at the end fsyncs, waits for the others and resolves :attr:`SafetensorsStreamWriter.result`, a future
  of the file's manifest entry (``{"bytes": n, "xxh3_128": hex}``).

The layout is the one safetensors reads: an 8-byte little-endian header length, the JSON header
(``{key: {dtype, shape, data_offsets}}`` plus ``__metadata__``) padded with spaces to a multiple of 8,
then the tensors' bytes back to back in the planned order.
"""

from __future__ import annotations

import errno
import json
import math
import os
import queue
import struct
import sys
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from megamoe.checkpoint import checksums

__all__ = ["SAFETENSORS_DTYPES", "WRITEBACK_STEP", "PlannedTensor", "FileExtent", "group_into_files",
           "read_data_extents", "SafetensorsStreamWriter"]

if sys.byteorder != "little":       # safetensors stores little-endian; tensors are written as they lie
    raise ImportError("megamoe.checkpoint.safetensors_stream needs a little-endian machine")

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
    torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}

WRITEBACK_STEP = 64 * 1024**2
# Bytes per write or kernel copy call: small enough for the hash to follow the writers closely.
_IO_STEP = 16 * 1024**2
# Of the buffer (one per writing thread) gathering tensors that are not contiguous, a piece at a time.
_GATHER_BYTES = 4 * 1024**2
# Stable tensors waiting for a file's thread at most: they keep the pages of their mapped file that the
# thread has read resident (safetensors maps a file once for all its tensors), so RSS grows with them;
# past this the caller's thread writes them itself.
_QUEUED_TENSOR_BYTES = 8 * 1024**2
# Read back and hashed at a time: small enough to still be in the CPU cache when hashed.
_HASH_BLOCK = 1024**2
# copy_file_range refusals that mean "not between these files": copy through memory instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EBADF,
                   errno.EPERM}


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a file to be written."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class FileExtent:
    """``nbytes`` bytes of the file ``path`` starting at byte ``offset``."""

    path: str
    offset: int
    nbytes: int


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


def read_data_extents(path: str) -> dict[str, tuple[str, tuple[int, ...], FileExtent]]:
    """key -> (dtype code, shape, where its bytes lie) for every tensor of the safetensors file ``path``.
    ValueError for a header that is not a safetensors header or points past the end of the file."""
    with open(path, "rb") as f:
        length_bytes = f.read(8)
        if len(length_bytes) != 8:
            raise ValueError(f"{path} is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", length_bytes)
        size = os.fstat(f.fileno()).st_size
        if length > size - 8:
            raise ValueError(f"{path}: the header length {length} runs past the end of the file")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"{path}: the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    start = 8 + length
    extents = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = (int(o) for o in entry["data_offsets"])
            dtype, shape = str(entry["dtype"]), tuple(int(s) for s in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: the header entry of {key!r} is malformed") from None
        if not 0 <= begin <= end or start + end > size:
            raise ValueError(f"{path}: the data of {key!r} lies outside the file")
        extents[key] = (dtype, shape, FileExtent(path, start + begin, end - begin))
    return extents


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


def _pieces(tensor: torch.Tensor, max_bytes: int):
    """``tensor`` (any strides) as consecutive sub-tensors of at most ``max_bytes`` each, in row-major order:
    their bytes one after the other are the tensor's."""
    if tensor.numel() == 0:
        return
    if tensor.is_contiguous():
        flat = tensor.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), max_bytes):
            yield flat[start:start + max_bytes]
        return
    row_bytes = tensor[0].numel() * tensor.element_size()
    if row_bytes > max_bytes and tensor.dim() > 1:
        for row in tensor:
            yield from _pieces(row, max_bytes)
        return
    rows = max(1, max_bytes // row_bytes)
    for start in range(0, tensor.shape[0], rows):
        yield tensor[start:start + rows]


class SafetensorsStreamWriter:
    """Writes ``tensors`` to ``path`` in order: :meth:`write` each one, then :meth:`close`.

    ``write`` checks the key, dtype and shape against the plan and returns once the tensor's memory may be
    reused: bytes from memory are written at once, unless the memory is stable (a mapped file), copies and
    stable tensors are queued for the file's writing thread.
    ``close`` returns :attr:`result`, a future of the file's manifest entry (``{"bytes": n}`` only when
    ``checksum`` is false) resolved once the file is complete, hashed and fsynced; closing before every
    tensor was written is an error. :meth:`abort` stops everything and closes the file (the caller
    removes it); so does an exception inside a ``with`` block.
    """

    def __init__(self, path: str | os.PathLike, tensors: list[PlannedTensor], *,
                 metadata: dict[str, str] | None = None, checksum: bool = True):
        self.path = os.fspath(path)
        self._plan = list(tensors)
        self._next = 0
        header = _header(self._plan, metadata)
        self._size = len(header) + sum(t.nbytes for t in self._plan)
        self._end = 0                                   # of what has been given to write so far
        self._caller_gather: list[torch.Tensor | None] = [None]
        # For the file's thread, in file order: (FileExtent or stable tensor, offset, range entry); None ends.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        # Shared with the threads, under _state: the byte ranges given, in file order, each [end, done];
        # _written is the end of the completed ones at the start of the file (what the hash may read).
        self._state = threading.Condition()
        self._ranges: deque[list] = deque()
        self._written = 0
        self._queued_tensor_bytes = 0
        self._aborted = False
        self._error: BaseException | None = None
        self._digest = checksums.new_hasher() if checksum else None
        self.result: Future = Future()
        self._copier = threading.Thread(target=self._copy_loop, name=f"write {self.path}", daemon=True)
        self._hasher = threading.Thread(target=self._hash_loop, name=f"checksum {self.path}", daemon=True)
        self._finisher = threading.Thread(target=self._finish_loop, name=f"fsync {self.path}", daemon=True)
        self._copier.start()
        if checksum:
            self._hasher.start()
        self._finisher.start()
        try:
            self._put(memoryview(header))
        except BaseException:
            self.abort()
            raise

    @property
    def next_key(self) -> str | None:
        return self._plan[self._next].key if self._next < len(self._plan) else None

    def write(self, key: str, tensor: torch.Tensor, extents: list[FileExtent] | None = None, *,
              stable: bool = False) -> None:
        """The next planned tensor: its bytes from memory (any strides), or with ``extents``, copied from the
        files whose byte ranges, one after the other, hold them (``tensor`` then only gives the dtype and
        shape, and may be a meta tensor). ``stable``: the tensor's memory does not change (a view of a
        mapped file), so the file's thread may write it later (up to a few MB of such tensors are queued);
        else it is written before returning."""
        if self._error is not None:
            raise OSError(f"writing {self.path} failed: {self._error}") from self._error
        if self._next >= len(self._plan):
            raise ValueError(f"{self.path}: {key!r} is not planned for this file (all its tensors are written)")
        planned = self._plan[self._next]
        if key != planned.key:
            raise ValueError(f"{self.path}: expected {planned.key!r} next, got {key!r}")
        if tensor.dtype != planned.dtype or tuple(tensor.shape) != planned.shape:
            raise ValueError(f"{self.path}: {key!r} is {tensor.dtype} {tuple(tensor.shape)}, planned "
                             f"{planned.dtype} {planned.shape}")
        if extents is not None:
            if sum(e.nbytes for e in extents) != planned.nbytes:
                raise ValueError(f"{self.path}: the file ranges given for {key!r} hold "
                                 f"{sum(e.nbytes for e in extents)} bytes, not its {planned.nbytes}")
            for extent in extents:
                if extent.nbytes:
                    offset = self._end
                    self._queue.put((extent, offset, self._give(extent.nbytes)))
        elif stable and planned.nbytes and self._queued_tensor_bytes + planned.nbytes <= _QUEUED_TENSOR_BYTES:
            offset = self._end
            with self._state:
                self._queued_tensor_bytes += planned.nbytes
            self._queue.put((tensor.detach(), offset, self._give(planned.nbytes)))
        else:
            for data in self._bytes_of(tensor.detach(), self._caller_gather):
                self._put(data)
        self._next += 1

    def close(self) -> Future:
        """No more tensors: the returned :attr:`result` resolves to the file's manifest entry once the
        file is written, hashed and on disk (the work goes on in the background meanwhile)."""
        if self._next != len(self._plan):
            missing = [t.key for t in self._plan[self._next:]]
            self.abort()
            raise ValueError(f"{self.path}: closed with {len(missing)} planned tensors unwritten: {missing[:4]}")
        self._queue.put(None)
        self._caller_gather[0] = None
        return self.result

    def abort(self) -> None:
        """Stop the threads and close the file without completing it (the caller removes it)."""
        with self._state:
            self._aborted = True
            self._state.notify_all()
        self._queue.put(None)
        for thread in (self._copier, self._hasher, self._finisher):
            if thread.is_alive():
                thread.join()
        if not self.result.done():
            self.result.set_exception(RuntimeError(f"{self.path}: writing was aborted"))
        self._close_fd()

    # ---- the byte ranges ------------------------------------------------------------------------
    def _give(self, nbytes: int) -> list:
        """The next ``nbytes`` of the file, to be written: its [end, done] entry."""
        self._end += nbytes
        entry = [self._end, False]
        with self._state:
            self._ranges.append(entry)
        return entry

    def _done(self, entry: list) -> None:
        with self._state:
            entry[1] = True
            while self._ranges and self._ranges[0][1]:
                self._written = self._ranges.popleft()[0]
            self._state.notify_all()

    def _put(self, data: memoryview) -> None:
        """Write ``data`` (in this thread) at the end of what was given."""
        offset, entry = self._end, self._give(len(data))
        self._pwrite(data, offset)
        self._done(entry)

    def _pwrite(self, data: memoryview, offset: int) -> None:
        while data:
            n = os.pwrite(self._fd, data, offset)
            data, offset = data[n:], offset + n

    @staticmethod
    def _bytes_of(tensor: torch.Tensor, gather: list[torch.Tensor | None]):
        """``tensor``'s bytes a piece at a time; pieces that are not contiguous are gathered in ``gather[0]``
        (a buffer of the calling thread, made on first use), valid until the next piece."""
        for piece in _pieces(tensor, _GATHER_BYTES):
            if not piece.is_contiguous():
                if gather[0] is None:
                    gather[0] = torch.empty(_GATHER_BYTES, dtype=torch.uint8)
                nbytes = piece.numel() * piece.element_size()
                piece = gather[0][:nbytes].view(piece.dtype).view(piece.shape).copy_(piece)
            yield memoryview(piece.reshape(-1).view(torch.uint8).numpy())

    def _close_fd(self) -> None:
        with self._state:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _fail(self, error: BaseException) -> None:
        """A thread failed: stop the others; the caller's next write and the result raise ``error``."""
        with self._state:
            if self._error is None:
                self._error = error
            self._aborted = True
            self._state.notify_all()

    # ---- the threads ----------------------------------------------------------------------------
    def _copy_loop(self) -> None:
        """Write the queued stable tensors, and carry out the queued copies: in the kernel, or through memory
        where the file systems refuse."""
        sources: dict[str, int] = {}                    # path -> descriptor of the files copied from
        buffer: memoryview | None = None                # for copies through memory, once needed
        gather: list[torch.Tensor | None] = [None]
        try:
            while (item := self._queue.get()) is not None:
                if self._aborted:
                    continue
                what, offset, entry = item
                try:
                    if isinstance(what, torch.Tensor):
                        for data in self._bytes_of(what, gather):
                            self._pwrite(data, offset)
                            offset += len(data)
                        with self._state:
                            self._queued_tensor_bytes -= what.numel() * what.element_size()
                        del what, item             # the last view of its mapped file may go with it
                        self._done(entry)
                        continue
                    source = sources.get(what.path)
                    if source is None:
                        source = sources[what.path] = os.open(what.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    done = 0
                    while done < what.nbytes:
                        step = min(what.nbytes - done, _IO_STEP)
                        n = None
                        if buffer is None:
                            try:
                                n = os.copy_file_range(source, self._fd, step, what.offset + done, offset + done)
                            except OSError as e:
                                if e.errno not in _NO_KERNEL_COPY:
                                    raise
                                buffer = memoryview(bytearray(_IO_STEP))
                        if n is None:
                            n = os.preadv(source, [buffer[:step]], what.offset + done)
                            self._pwrite(buffer[:n], offset + done)
                        if n == 0:
                            raise OSError(f"{what.path} ends before byte {what.offset + what.nbytes} (changed "
                                          "while being read?)")
                        done += n
                    self._done(entry)
                except BaseException as e:  # noqa: BLE001 - handed to the caller and the result
                    self._fail(e)
        finally:
            for fd in sources.values():
                os.close(fd)

    def _hash_loop(self) -> None:
        """Hash the file's bytes as they are completed, read back a block at a time."""
        block = memoryview(bytearray(_HASH_BLOCK))
        hashed = 0
        try:
            while hashed < self._size:
                with self._state:
                    while not self._aborted and self._written == hashed:
                        self._state.wait()
                    if self._aborted:
                        return
                    end = self._written
                while hashed < end and not self._aborted:
                    n = os.preadv(self._fd, [block[:min(_HASH_BLOCK, end - hashed)]], hashed)
                    if n == 0:
                        raise OSError(f"{self.path} shrank while being hashed")
                    self._digest.update(block[:n])
                    hashed += n
        except BaseException as e:  # noqa: BLE001 - handed to the caller and the result
            self._fail(e)

    def _finish_loop(self) -> None:
        """Start writeback every WRITEBACK_STEP bytes; once complete, fsync, wait for the hash, resolve."""
        synced = 0
        try:
            while True:
                with self._state:
                    while (not self._aborted and self._written < self._size
                           and self._written - synced < WRITEBACK_STEP):
                        self._state.wait()
                    if self._aborted:
                        break
                    target = self._written
                if target == self._size:
                    os.fsync(self._fd)
                    break
                os.fdatasync(self._fd)
                synced = target
        except BaseException as e:  # noqa: BLE001 - handed to the caller and the result
            self._fail(e)
        if self._digest is not None:
            self._hasher.join()
        if self._aborted:
            if self._error is not None:         # else abort() resolves the result
                self._copier_done_then_close()
                self.result.set_exception(self._error)
            return
        self._copier_done_then_close()
        self.result.set_result({"bytes": self._size} if self._digest is None
                               else checksums.entry(self._size, self._digest))

    def _copier_done_then_close(self) -> None:
        """Close the file once no thread may use it: the copier ends at close() or abort()."""
        self._copier.join()
        self._close_fd()

    def __enter__(self) -> "SafetensorsStreamWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()
