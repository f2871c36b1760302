"""A read-only, zero-copy reader of Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``).

Layout of ``PREFIX.idx`` (the ``MMIDIDX`` format Megatron-LM's ``IndexedDatasetBuilder`` writes; all
integers little-endian):

====================  ===========================  ===========================================
bytes                 type                         meaning
====================  ===========================  ===========================================
0..9                  ``b"MMIDIDX\\x00\\x00"``     magic
9..17                 uint64                       version, 1
17                    uint8                        dtype code of the tokens (``MEGATRON_DTYPES``)
18..26                uint64                       S, the number of sequences
26..34                uint64                       D, the length of the document index array
34..                  int32 [S]                    tokens per sequence
                      int64 [S]                    byte offset of each sequence in ``.bin``
                      int64 [D]                    document boundaries: document ``j`` is sequences
                                                   ``[doc[j], doc[j+1])``; ``doc[0] == 0``,
                                                   ``doc[-1] == S``, so D - 1 documents
(multimodal only)     int8 [S]                     the mode of each sequence
====================  ===========================  ===========================================

``PREFIX.bin`` holds the sequences' tokens back to back in that dtype. Nothing in the header flags the
multimodal variant (Megatron's reader is told by its caller); its extra S bytes are recognised from the
``.idx`` size and refused: its sequences are not all text tokens.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import numpy as np

__all__ = ["MEGATRON_DTYPES", "MEGATRON_MAGIC", "megatron_paths", "is_megatron_dataset", "MegatronIndexedDataset"]

logger = logging.getLogger(__name__)

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
# Every dtype code Megatron-LM's DType enum defines.
MEGATRON_DTYPES = {
    1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"), 5: np.dtype("<i8"),
    6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2"),
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document index count
_SUFFIXES = (".bin", ".idx")
# Index entries validated at a time: bounds the memory of checking an index of any size.
_CHECK_CHUNK = 1 << 22


def megatron_paths(path: str | os.PathLike) -> tuple[Path, Path, Path]:
    """``(prefix, prefix.bin, prefix.idx)`` for a dataset named by its prefix or by either file."""
    path = Path(path)
    prefix = path.with_suffix("") if path.suffix in _SUFFIXES else path
    return prefix, Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def is_megatron_dataset(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a Megatron dataset: a prefix with a ``.idx`` beside it, or a ``.bin`` /
    ``.idx`` path whose ``.idx`` exists (a missing ``.bin`` is then the reader's error to report)."""
    _, _, idx_path = megatron_paths(path)
    return idx_path.is_file()


def _fail(path: Path, problem: str) -> ValueError:
    return ValueError(f"Megatron index {path}: {problem}; rebuild the dataset (Megatron-LM's "
                      "tools/preprocess_data.py writes this format)")


class MegatronIndexedDataset:
    """The sequences of a Megatron indexed dataset, memory-mapped (nothing is read whole).

    ``dataset[i]`` is sequence ``i`` as a read-only numpy view; ``tokens`` is every token of ``.bin``
    as one flat view (the sequences are contiguous and in order, checked on open), so fixed-length
    samples may cross sequence and document boundaries. Every array is checked against the header and
    the file sizes before use; a ValueError names the file and what is wrong with it.
    """

    def __init__(self, path: str | os.PathLike):
        self.prefix, self.bin_path, self.idx_path = megatron_paths(path)
        for file in (self.idx_path, self.bin_path):
            if not file.is_file():
                raise FileNotFoundError(
                    f"Megatron dataset {self.prefix}: {file} does not exist (a dataset is PREFIX.bin + PREFIX.idx; "
                    "pass the prefix or either file)"
                )
        idx_bytes = self.idx_path.stat().st_size
        if idx_bytes < _HEADER.size:
            raise _fail(self.idx_path, f"{idx_bytes} bytes, shorter than the {_HEADER.size}-byte header")
        with open(self.idx_path, "rb") as file:
            magic, version, dtype_code, num_sequences, doc_index_len = _HEADER.unpack(file.read(_HEADER.size))
        if magic != MEGATRON_MAGIC:
            raise _fail(self.idx_path, f"bad header magic {magic!r} (expected {MEGATRON_MAGIC!r}): not an MMIDIDX file")
        if version != MEGATRON_VERSION:
            raise _fail(self.idx_path, f"unknown version {version} (this reader knows version {MEGATRON_VERSION})")
        if dtype_code not in MEGATRON_DTYPES:
            raise _fail(self.idx_path, f"unknown dtype code {dtype_code} (known: {sorted(MEGATRON_DTYPES)})")
        self.dtype_code = dtype_code
        self.dtype = MEGATRON_DTYPES[dtype_code]

        arrays_bytes = num_sequences * (4 + 8) + doc_index_len * 8
        expected = _HEADER.size + arrays_bytes
        if idx_bytes == expected + num_sequences and num_sequences > 0:
            raise _fail(self.idx_path, f"multimodal (it has {num_sequences} per-sequence mode bytes after the "
                                       "document index): megamoe trains on text-only datasets")
        if idx_bytes != expected:
            raise _fail(self.idx_path, f"{idx_bytes} bytes, but its header ({num_sequences} sequences, "
                                       f"{doc_index_len} document index entries) needs {expected}")

        offset = _HEADER.size
        self.sequence_lengths = self._idx_array(np.dtype("<i4"), offset, num_sequences)
        offset += num_sequences * 4
        self.sequence_pointers = self._idx_array(np.dtype("<i8"), offset, num_sequences)
        offset += num_sequences * 8
        self.document_indices = self._idx_array(np.dtype("<i8"), offset, doc_index_len)
        self._check_documents()
        self.num_tokens = self._check_contiguous()
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
                       if self.num_tokens else np.empty(0, dtype=self.dtype))
        logger.info("opened Megatron dataset %s: %d sequences, %d documents, %d %s tokens", self.prefix,
                    len(self), self.num_documents, self.num_tokens, self.dtype.name)

    def _idx_array(self, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype=dtype)
        return np.memmap(self.idx_path, dtype=dtype, mode="r", offset=offset, shape=(count,))

    def _check_documents(self) -> None:
        doc = self.document_indices
        rising = all(not np.any(np.diff(doc[start:start + _CHECK_CHUNK + 1]) < 0)
                     for start in range(0, doc.size, _CHECK_CHUNK))
        if doc.size == 0 or doc[0] != 0 or doc[-1] != len(self) or not rising:
            raise _fail(self.idx_path, f"its document index must rise from 0 to the sequence count {len(self)}, got "
                                       f"{doc.size} entries from {doc[:1].tolist()} to {doc[-1:].tolist()}")

    def _check_contiguous(self) -> int:
        """The token count; ValueError unless sequence ``i`` starts where ``i - 1`` ends and the last ends
        at the end of ``.bin``. Chunked, so that checking a huge index needs little memory."""
        itemsize = self.dtype.itemsize
        next_pointer = 0
        for start in range(0, len(self), _CHECK_CHUNK):
            lengths = self.sequence_lengths[start:start + _CHECK_CHUNK].astype(np.int64)
            if np.any(lengths < 0):
                first_negative = start + int(np.argmax(lengths < 0))
                raise _fail(self.idx_path, f"negative sequence length at sequence {first_negative}")
            ends = next_pointer + np.cumsum(lengths) * itemsize
            expected_pointers = np.concatenate([[next_pointer], ends[:-1]])
            pointers = self.sequence_pointers[start:start + _CHECK_CHUNK]
            mismatch = np.flatnonzero(pointers != expected_pointers)
            if mismatch.size:
                i = int(mismatch[0])
                raise _fail(self.idx_path, f"sequence {start + i} starts at byte {int(pointers[i])} of "
                                           f"{self.bin_path.name}, not at {int(expected_pointers[i])} where the "
                                           "previous one ends: the sequences are not contiguous")
            next_pointer = int(ends[-1])
        num_tokens = next_pointer // itemsize
        bin_bytes = self.bin_path.stat().st_size
        if bin_bytes != next_pointer:
            raise ValueError(
                f"Megatron data file {self.bin_path} has {bin_bytes} bytes, but its index {self.idx_path.name} "
                f"describes {num_tokens} {self.dtype.name} tokens ({next_pointer} bytes): the pair is "
                "truncated or from different builds; rebuild the dataset"
            )
        return num_tokens

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size - 1)

    @property
    def holds_token_ids(self) -> bool:
        """False for the float dtypes (codes 6 and 7): those datasets hold values, not token ids."""
        return self.dtype.kind in "iu"

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def __getitem__(self, index: int) -> np.ndarray:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence index {index} out of range for {len(self)} sequences of {self.prefix}")
        index %= len(self)
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sequence_lengths[index])]

    def document_token_bounds(self) -> np.ndarray:
        """Where each document's tokens begin in ``tokens``, and where the last ends: int64 [num_documents + 1],
        rising from 0 to ``num_tokens`` (an empty document begins where the next does)."""
        sequence_starts = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=sequence_starts[1:])
        return sequence_starts[np.asarray(self.document_indices)]

    def document(self, index: int) -> np.ndarray:
        """Every token of document ``index`` (its sequences, contiguous): a view."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document index {index} out of range for {self.num_documents} documents of {self.prefix}")
        first, end = int(self.document_indices[index]), int(self.document_indices[index + 1])
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize if first < end else 0
        return self.tokens[start:start + int(self.sequence_lengths[first:end].sum())]
