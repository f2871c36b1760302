"""Tokenized chat documents: every document's token ids and assistant mask back to back, and where each
document starts; stored as one safetensors file (no pickle), read back verified.

``ids`` [N] integers (uint32 as read back), ``assistant`` [N] bool (the token is the assistant's: trained), ``offsets`` [D + 1]
int64 (document ``d`` is ``[offsets[d], offsets[d + 1])``, ``offsets[0] == 0``, ``offsets[-1] == N``),
``conversations`` [C + 1] int64 (conversation ``c`` made documents ``[conversations[c], conversations[c +
1])``: a held-out conversation takes all its documents). The file (:func:`save_chat_documents`) holds
them as ``ids`` (uint32), ``assistant`` (uint8), ``offsets`` and ``conversations`` (int64), and its
metadata the format and how they were made (the rule): written under a temporary name and renamed, so a
crash leaves no partial file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from megamoe.atomic_file import atomic_write

__all__ = ["FORMAT", "ChatDocuments", "bounds_of", "save_chat_documents", "load_chat_documents"]

FORMAT = "megamoe.chat_documents.v1"


@dataclass(frozen=True)
class ChatDocuments:
    """See the module docstring; ``info`` is what made them (JSON values: the rule, the counts)."""

    ids: np.ndarray
    assistant: np.ndarray
    offsets: np.ndarray
    conversations: np.ndarray
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        ids, assistant = self.ids, self.assistant
        if ids.ndim != 1 or assistant.shape != ids.shape:
            raise ValueError(f"ChatDocuments.ids and .assistant must be 1-D of one length, got {ids.shape} and "
                             f"{assistant.shape}")
        for name, bounds, total in (("offsets", self.offsets, ids.size),
                                    ("conversations", self.conversations, self.offsets.size - 1)):
            if bounds.ndim != 1 or bounds.size < 1 or bounds[0] != 0 or bounds[-1] != total \
                    or np.any(np.diff(bounds) < 1):
                raise ValueError(f"ChatDocuments.{name} must rise from 0 to {total}, no part empty")

    @property
    def num_documents(self) -> int:
        return self.offsets.size - 1

    @property
    def num_conversations(self) -> int:
        return self.conversations.size - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @staticmethod
    def concatenate(parts: Sequence[ChatDocuments]) -> ChatDocuments:
        """``parts``' conversations one after the other (``info`` of the first)."""
        if not parts:
            raise ValueError("ChatDocuments.concatenate needs at least one part")
        return ChatDocuments(np.concatenate([part.ids for part in parts]),
                             np.concatenate([part.assistant for part in parts]),
                             _joined([part.offsets for part in parts]), _joined([part.conversations for part in parts]),
                             dict(parts[0].info))

    def select(self, conversations: np.ndarray) -> ChatDocuments:
        """The conversations of indices ``conversations`` (with all their documents), in that order."""
        conversations = np.asarray(conversations, dtype=np.int64)
        documents = _ranges(self.conversations[conversations], self.conversations[conversations + 1])
        positions = _ranges(self.offsets[documents], self.offsets[documents + 1])
        return ChatDocuments(self.ids[positions], self.assistant[positions],
                             bounds_of(np.diff(self.offsets)[documents]),
                             bounds_of(np.diff(self.conversations)[conversations]), dict(self.info))


def bounds_of(lengths) -> np.ndarray:
    """[n + 1] int64 bounds (from 0) of consecutive parts of ``lengths``."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The indices of the ranges ``[starts[k], ends[k])``, one after the other."""
    lengths = ends - starts
    return np.repeat(starts - bounds_of(lengths)[:-1], lengths) + np.arange(int(lengths.sum()))


def _joined(bounds: Sequence[np.ndarray]) -> np.ndarray:
    """Bounds arrays (each from 0) of consecutive parts, as one."""
    shifts = np.cumsum([0] + [b[-1] for b in bounds[:-1]])
    return np.concatenate([[0]] + [b[1:] + shift for b, shift in zip(bounds, shifts)]).astype(np.int64)


def save_chat_documents(documents: ChatDocuments, path: str | os.PathLike) -> None:
    """Write ``documents`` to ``path`` (see the module docstring)."""
    from safetensors.numpy import save

    if documents.ids.size and (documents.ids.min() < 0 or documents.ids.max() >= 1 << 32):
        raise ValueError("chat token ids must fit uint32")
    blob = save({"ids": documents.ids.astype(np.uint32), "assistant": documents.assistant.astype(np.uint8),
                 "offsets": documents.offsets.astype(np.int64),
                 "conversations": documents.conversations.astype(np.int64)},
                metadata={"format": FORMAT, "info": json.dumps(documents.info)})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as file:
        file.write(blob)


def load_chat_documents(path: str | os.PathLike, *, vocab_size: int | None = None) -> ChatDocuments:
    """The documents of ``path``, checked: the format, dtypes and shapes, offsets, the mask's values and
    (with ``vocab_size``) every id below it. ValueError naming the file otherwise."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(path, framework="numpy") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except (OSError, SafetensorError, ValueError) as e:
        raise ValueError(f"cannot read chat documents {path}: {e}") from None
    if metadata.get("format") != FORMAT or set(tensors) != {"ids", "assistant", "offsets", "conversations"}:
        raise ValueError(f"{path} is not a {FORMAT} file (format {metadata.get('format')!r}, tensors "
                         f"{sorted(tensors)})")
    ids, assistant, offsets, conversations = (tensors[name] for name in ("ids", "assistant", "offsets", "conversations"))
    if (ids.dtype, assistant.dtype, offsets.dtype, conversations.dtype) != (np.uint32, np.uint8, np.int64, np.int64):
        raise ValueError(f"{path}: unexpected dtypes {ids.dtype}, {assistant.dtype}, {offsets.dtype}, "
                         f"{conversations.dtype}")
    if assistant.size and assistant.max() > 1:
        raise ValueError(f"{path}: the assistant mask holds values other than 0 and 1")
    if vocab_size is not None and ids.size and int(ids.max()) >= vocab_size:
        raise ValueError(f"{path}: token id {int(ids.max())} is outside the tokenizer's vocabulary of {vocab_size}")
    try:
        info = json.loads(metadata.get("info", "{}"))
        return ChatDocuments(ids, assistant.view(bool), offsets, conversations, info)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
