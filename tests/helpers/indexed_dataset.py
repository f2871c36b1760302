"""Shared by tests/unit/test_indexed_dataset.py (and other tests): the builders and constants of the indexed dataset
tests."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np


# Megatron-LM's DType codes, restated from its source (not imported from the reader under test).
SPEC_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


def write_megatron(prefix: Path, documents: list[list[list[int]]], code: int, *, version: int = 1,
                   magic: bytes = b"MMIDIDX\x00\x00", modes: bool = False) -> None:
    """An independent writer: documents -> sequences -> token ids, laid out as Megatron's builder does
    (header; int32 lengths; int64 byte pointers; int64 document index starting at 0; int8 modes if multimodal)."""
    dtype = np.dtype(SPEC_DTYPES.get(code, "<i4"))
    sequences = [sequence for document in documents for sequence in document]
    lengths = [len(sequence) for sequence in sequences]
    pointers, offset = [], 0
    for length in lengths:
        pointers.append(offset)
        offset += length * dtype.itemsize
    doc_index = [0]
    for document in documents:
        doc_index.append(doc_index[-1] + len(document))
    with open(f"{prefix}.bin", "wb") as file:
        for sequence in sequences:
            file.write(np.array(sequence, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as file:
        file.write(magic)
        file.write(struct.pack("<Q", version))
        file.write(struct.pack("<B", code))
        file.write(struct.pack("<Q", len(sequences)))
        file.write(struct.pack("<Q", len(doc_index)))
        file.write(struct.pack(f"<{len(lengths)}i", *lengths))
        file.write(struct.pack(f"<{len(pointers)}q", *pointers))
        file.write(struct.pack(f"<{len(doc_index)}q", *doc_index))
        if modes:
            file.write(bytes(len(sequences)))
