"""One interface over the token files training reads: a megamoe token file (``build_token_file``) or a
Megatron-LM indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), both memory-mapped as a flat array of ids.

``open_token_source(path)`` tells them apart: a path with a megamoe sidecar (``<path>.json``) is a
megamoe token file; a prefix, ``.bin`` or ``.idx`` path with a ``PREFIX.idx`` beside it is a Megatron
dataset; anything else is reported with the megamoe token file's errors (missing file, missing sidecar).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megamoe.data.indexed_dataset import MegatronIndexedDataset, is_megatron_dataset
from megamoe.data.token_file_meta import TokenFileMeta, sidecar_path

__all__ = ["TokenSource", "open_token_source", "open_token_file"]

# Tokens the id check (and the EOS search) reads at a time: bounds its memory for files of any size.
_ID_CHECK_CHUNK = 1 << 24


@dataclass(frozen=True, eq=False)
class TokenSource:
    """A flat, read-only sequence of token ids and what is known about them.

    ``vocab_size`` and ``eos_id`` are None where the format does not record them (Megatron datasets):
    the caller then knows them from its tokenizer (``TokenDataset(..., vocab_size=...)`` checks the ids,
    with :meth:`check_ids`). ``meta`` is the sidecar of a megamoe token file, None for Megatron datasets.
    """

    path: Path
    format: str  # "megamoe" or "megatron"
    tokens: np.ndarray  # 1-D, integer dtype, memory-mapped
    num_documents: int
    vocab_size: int | None
    eos_id: int | None
    meta: TokenFileMeta | None = None
    index: MegatronIndexedDataset | None = None  # a Megatron dataset's reader (its document index)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def document_bounds(self) -> np.ndarray:
        """Where each document's tokens begin, and where the last ends: int64 [documents + 1], rising from
        0 to ``num_tokens``. A Megatron dataset's document index says; in a megamoe token file built with
        ``append_eos`` a document ends after each EOS (found by one vectorised pass); without EOS the
        boundaries were not kept, and that is a ValueError."""
        if self.index is not None:
            return self.index.document_token_bounds()
        if self.meta is None or not self.meta.append_eos:
            raise ValueError(f"{self} records no document boundaries: it was built without an EOS after each "
                             "document (--no-append-eos)")
        ends = [np.flatnonzero(self.tokens[start:start + _ID_CHECK_CHUNK] == self.eos_id) + (start + 1)
                for start in range(0, self.num_tokens, _ID_CHECK_CHUNK)]
        bounds = np.concatenate([np.zeros(1, dtype=np.int64), *ends]).astype(np.int64)
        return bounds if bounds[-1] == self.num_tokens else np.append(bounds, self.num_tokens)

    def __str__(self) -> str:
        return f"{self.format} token source {self.path}"

    def check_ids(self, vocab_size: int) -> None:
        """ValueError naming the first token id outside ``[0, vocab_size)`` and where it is. One vectorised
        pass over the file (min and max per chunk; a dtype that cannot hold such an id is not read)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        limits = np.iinfo(self.tokens.dtype)
        if limits.min >= 0 and limits.max < vocab_size:
            return
        for start in range(0, self.num_tokens, _ID_CHECK_CHUNK):
            chunk = self.tokens[start:start + _ID_CHECK_CHUNK]
            if chunk.min() >= 0 and chunk.max() < vocab_size:
                continue
            position = int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
            raise ValueError(
                f"{self}: token {start + position} is id {int(chunk[position])}, outside the vocabulary "
                f"[0, {vocab_size}) of the tokenizer: the data was tokenized with another tokenizer, or the file "
                "is damaged; tokenize the documents again with the run's tokenizer"
            )


def open_token_file(path: str | os.PathLike) -> TokenSource:
    """A megamoe token file, checked against its sidecar (present, valid, size as recorded)."""
    path = Path(path)
    sidecar = sidecar_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist (nor a Megatron dataset {path}.idx)")
    if not sidecar.is_file():
        raise FileNotFoundError(
            f"token file {path} has no sidecar {sidecar.name}: its build was interrupted, or it was not written "
            "by build_token_file; rebuild it (a Megatron dataset needs its .idx beside the .bin)"
        )
    meta = TokenFileMeta.read(sidecar)
    expected_bytes = meta.num_tokens * meta.numpy_dtype.itemsize
    actual_bytes = path.stat().st_size
    if actual_bytes != expected_bytes:
        raise ValueError(
            f"token file {path} is truncated or corrupt: its sidecar says {meta.num_tokens} {meta.dtype} tokens "
            f"({expected_bytes} bytes), the file has {actual_bytes} bytes"
        )
    tokens = (np.memmap(path, dtype=meta.numpy_dtype, mode="r", shape=(meta.num_tokens,))
              if meta.num_tokens else np.empty(0, dtype=meta.numpy_dtype))
    return TokenSource(path=path, format="megamoe", tokens=tokens, num_documents=meta.num_documents,
                       vocab_size=meta.vocab_size, eos_id=meta.eos_id, meta=meta)


def open_token_source(path: str | os.PathLike) -> TokenSource:
    """The token source at ``path``: a megamoe token file, or a Megatron dataset named by its prefix or
    either of its files. Megatron datasets of float values (dtype codes 6, 7) are refused."""
    path = Path(path)
    if sidecar_path(path).is_file() or not is_megatron_dataset(path):
        return open_token_file(path)
    dataset = MegatronIndexedDataset(path)
    if not dataset.holds_token_ids:
        raise ValueError(
            f"Megatron dataset {dataset.prefix} holds {dataset.dtype.name} values (dtype code {dataset.dtype_code}), "
            "not token ids: training needs an integer dataset (Megatron's preprocess_data.py writes uint16 or int32)"
        )
    return TokenSource(path=dataset.prefix, format="megatron", tokens=dataset.tokens,
                       num_documents=dataset.num_documents, vocab_size=None, eos_id=None, index=dataset)
