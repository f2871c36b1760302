"""A HuggingFace model directory on disk: config.json, safetensors weights (one file, or shards with
``model.safetensors.index.json``) and side files (tokenizer, generation config, ...), read lazily.

Opening checks everything that can be checked without reading tensor data: every weight file's header
(safetensors refuses a truncated file or a corrupt header), that the index and the files agree (no
tensor missing from its file, none unlisted, none in two files), and that every dtype is known.

A downloaded directory is untrusted input: config.json, the index, every weight file the index names and every
file found in the directory must be plain relative names resolving inside it
(:mod:`megamoe.checkpoint.safe_names`; a hub cache snapshot's links into its repository's ``blobs/`` are
accepted). A side file that is a link leading elsewhere is refused rather than skipped: skipping would quietly
drop a tokenizer file from the conversion, and a link that ``from_pretrained`` would not follow either is not
something to copy.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Iterator

import torch

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.read_window import ReadWindow
from megamoe.checkpoint.safe_names import check_regular_file, hub_cache_roots, resolve_inside
from megamoe.checkpoint.safetensors_stream import SAFETENSORS_DTYPES, FileExtent, read_data_extents

__all__ = ["CONFIG_FILE", "INDEX_FILE", "HFTensorInfo", "HFCheckpoint", "is_weight_file"]

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
_DTYPE_OF_CODE = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
# Weights in any format, and their indexes: never copied along as side files.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def is_weight_file(name: str) -> bool:
    return name == CONFIG_FILE or name.endswith(_WEIGHT_SUFFIXES)


@dataclass(frozen=True)
class HFTensorInfo:
    file: str                   # file name inside the directory
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int                 # of its first byte in the file

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def _corrupt(path: str, error: Exception) -> ConversionError:
    return ConversionError(f"{path} is truncated or corrupt: {error}")


def _inside(directory: str, name: str, what: str) -> str:
    return resolve_inside(directory, name, what, error=ConversionError, extra_roots=hub_cache_roots(directory))


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"{path} is missing: a HuggingFace model directory has a {what}") from None
    except (OSError, ValueError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


class HFCheckpoint:
    """An opened HF model directory: ``config`` (config.json as a dict), ``tensors`` (key ->
    :class:`HFTensorInfo`, in file order) and ``side_files`` (names of the other top-level files)."""

    def __init__(self, directory: str, config: dict, tensors: dict[str, HFTensorInfo], side_files: list[str]):
        self.directory, self.config, self.tensors, self.side_files = directory, config, tensors, side_files

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "HFCheckpoint":
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise ConversionError(f"{directory} is not a directory (expected a HuggingFace model directory)")
        config = _read_json(_inside(directory, CONFIG_FILE, directory), CONFIG_FILE)
        index_path = _inside(directory, INDEX_FILE, directory)
        listed: dict[str, str] | None = None
        if os.path.exists(index_path):
            weight_map = _read_json(index_path, INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{index_path} has no weight_map")
            listed = weight_map
            files = sorted(set(weight_map.values()), key=str)
            for name in files:
                if not os.path.isfile(_inside(directory, name, f"{index_path}: weight_map")):
                    raise ConversionError(f"{index_path} lists {name}, which is missing from {directory}")
        else:
            pattern = os.path.join(glob.escape(directory), "*.safetensors")
            files = sorted(os.path.basename(p) for p in glob.glob(pattern))
            for name in files:
                _inside(directory, name, directory)
            if not files:
                others = sorted(n for n in os.listdir(directory) if is_weight_file(n) and n != CONFIG_FILE)
                hint = f" (found {', '.join(others)}: only safetensors weights are supported)" if others else ""
                raise ConversionError(f"no safetensors weights in {directory}{hint}")
        tensors: dict[str, HFTensorInfo] = {}
        for name in files:
            tensors.update(cls._read_header(directory, name, tensors))
        if listed is not None:
            for key, name in listed.items():
                if key not in tensors:
                    raise ConversionError(f"missing tensor {key!r}: {INDEX_FILE} places it in {name}, which does not "
                                          "hold it")
                if tensors[key].file != name:
                    raise ConversionError(f"{INDEX_FILE} places {key!r} in {name}, but it is in {tensors[key].file}")
            unlisted = [k for k in tensors if k not in listed]
            if unlisted:
                raise ConversionError(f"unexpected tensor {unlisted[0]!r} in {tensors[unlisted[0]].file}: not "
                                      f"listed in {INDEX_FILE} ({len(unlisted)} such tensors)")
        return cls(directory, config, tensors, cls.side_files_of(directory))

    @staticmethod
    def side_files_of(directory: str) -> list[str]:
        """The top-level files of an HF directory that are neither config.json nor weights. A link
        leading outside the directory, a link loop, and anything but a regular file (a FIFO, whose
        opening would block; a socket, a device) are refused, found by ``stat`` alone: nothing is opened."""
        names = sorted(n for n in os.listdir(directory)
                       if not is_weight_file(n) and not os.path.isdir(os.path.join(directory, n)))
        for name in names:
            check_regular_file(_inside(directory, name, f"{directory}: side file"), "side file", ConversionError)
        return names

    @staticmethod
    def _read_header(directory: str, name: str, seen: dict[str, HFTensorInfo]) -> dict[str, HFTensorInfo]:
        path = os.path.join(directory, name)
        found: dict[str, HFTensorInfo] = {}
        with ReadWindow(open_error=_corrupt) as window:
            handle = window.handle(path)            # safetensors' own checks of the header and the size
            try:
                extents = read_data_extents(path)
            except ValueError as e:
                raise _corrupt(path, e) from None
            for key in handle.keys():
                if key in seen:
                    raise ConversionError(f"tensor {key!r} is stored twice: in {seen[key].file} and in {name}")
                view = handle.get_slice(key)
                code = view.get_dtype()
                if code not in _DTYPE_OF_CODE:
                    raise ConversionError(f"{path}: tensor {key!r} has dtype {code}, which is not supported "
                                          f"(supported: {', '.join(sorted(_DTYPE_OF_CODE))})")
                info = HFTensorInfo(name, _DTYPE_OF_CODE[code], tuple(view.get_shape()), extents[key][2].offset)
                if extents[key][2].nbytes != info.nbytes:
                    raise _corrupt(path, ValueError(f"{key!r} has {extents[key][2].nbytes} bytes of data for its "
                                                    f"{info.nbytes}"))
                found[key] = info
        return found

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def extent(self, key: str) -> FileExtent:
        """Where the bytes of tensor ``key`` lie."""
        info = self.tensors[key]
        return FileExtent(os.path.join(self.directory, info.file), info.offset, info.nbytes)

    def iter_tensors(self, keys: Iterable[str], window: ReadWindow, placeholders: Collection[str] = (),
                     scan: Callable[[str, torch.Tensor], None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key, tensor)`` for ``keys`` in that order, each read when the consumer asks for it; tensors
        view the mapped file (no copy). Keys in ``placeholders`` are not read: their tensor is a meta
        tensor of the right dtype and shape (for a consumer that copies the bytes at :meth:`extent`).
        ``scan(key, tensor)`` sees every tensor's values first, the placeholders' included (a view of the
        mapping: the pages the file-to-file copy reads next)."""
        for key in keys:
            info = self.tensors[key]
            if key in placeholders and scan is None:
                yield key, torch.empty(info.shape, dtype=info.dtype, device="meta")
                continue
            path = os.path.join(self.directory, info.file)
            try:
                tensor = window.handle(path).get_tensor(key)
            except ConversionError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever safetensors raises for a damaged file
                raise _corrupt(path, e) from e
            window.account(info.nbytes)
            if scan is not None:
                scan(key, tensor)
            if key in placeholders:
                tensor = torch.empty(info.shape, dtype=info.dtype, device="meta")
            yield key, tensor
