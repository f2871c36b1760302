"""Chat SFT samples: tokenized chat documents (:class:`~megamoe.data.chat_documents.ChatDocuments`) packed
whole into rows of ``seq_len`` tokens, with their document masks; labels only on the assistant's tokens.

A document of ``n`` tokens takes ``n - 1`` positions of a row: inputs ``ids[:-1]``, labels ``ids[1:]``
where that next token is the assistant's, else ``IGNORE_INDEX`` (-100), so the loss is taken on the
assistant tokens only (end-of-turn included) and never across two documents. A row holds whole documents
(best-fit decreasing: the longest first, each into the row it fills best), their positions restarting at
0 and their ``document_ids`` keeping attention inside each (as packed pretraining,
:mod:`megamoe.data.packing`); the rest of a row is padding (``pad_id``, no label, a document of its own).

A document longer than ``seq_len + 1`` tokens is never split across rows. ``overlong``:

- ``truncate`` (the default): keep its first ``seq_len + 1`` tokens. The conversation's early turns train
  as the user gave them and the cut invents nothing: the truncated answer has no end-of-turn token, so the
  model is not taught to stop there. A truncated document with no assistant token left (a prompt longer
  than ``seq_len``) is dropped.
- ``drop``: leave it out.

Both are counted and logged. Samples are the packed rows, in a fixed order (the sampler shuffles them).
"""

from __future__ import annotations

import bisect
import logging
from typing import Sequence

import numpy as np
import torch

from megamoe.data.chat_documents import ChatDocuments
from megamoe.data.eval_split import IGNORE_INDEX, held_out_split
from megamoe.data.packing import MicroBatch
from megamoe.data.sample_dataset import checked_sample_indices

__all__ = ["OVERLONG_CHOICES", "ChatSamples", "split_chat_documents"]

logger = logging.getLogger(__name__)

OVERLONG_CHOICES = ("truncate", "drop")


def _best_fit_rows(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Items of ``lengths`` (each <= capacity) into rows of ``capacity``: best-fit decreasing."""
    order = np.argsort(-lengths, kind="stable")
    free: list[tuple[int, int]] = []          # (free positions, row), sorted
    rows: list[list[int]] = []
    for item in order.tolist():
        need = int(lengths[item])
        k = bisect.bisect_left(free, (need, -1))
        if k < len(free):
            left, row = free.pop(k)
            rows[row].append(item)
        else:
            left, row = capacity, len(rows)
            rows.append([item])
        left -= need
        if left > 0:
            bisect.insort(free, (left, row))
    return rows


class ChatSamples:
    """Packed rows of ``documents`` (see the module docstring): ``batch(indices)`` -> (inputs, labels)
    [B, seq_len] int64, ``micro_batch(indices)`` -> :class:`MicroBatch` with position and document ids.
    ``source`` names the data in messages and logs."""

    def __init__(self, documents: ChatDocuments, seq_len: int, *, overlong: str = "truncate", pad_id: int = 0,
                 source: str = "chat data"):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        if overlong not in OVERLONG_CHOICES:
            raise ValueError(f"overlong (--sft-overlong) must be one of {', '.join(OVERLONG_CHOICES)}, got "
                             f"{overlong!r}")
        self.documents, self.seq_len, self.pad_id = documents, seq_len, pad_id
        starts, lengths = documents.offsets[:-1], documents.lengths - 1          # positions each takes
        overlong_b = lengths > seq_len
        keep = lengths > 0
        if overlong == "drop":
            keep &= ~overlong_b
        lengths = np.minimum(lengths, seq_len)
        # A label is the next token's: trained where that token is the assistant's.
        trained = np.add.reduceat(documents.assistant.astype(np.int64), starts) - documents.assistant[starts]
        trained_kept = trained.copy()
        for k in np.flatnonzero(overlong_b).tolist():
            trained_kept[k] = documents.assistant[starts[k] + 1:starts[k] + 1 + seq_len].sum()
        no_label_left = keep & (trained_kept == 0)
        keep &= ~no_label_left
        self.starts, self.lengths = starts[keep], lengths[keep]
        if self.starts.size == 0:
            raise ValueError(f"{source}: no document leaves an assistant token to train on within --seq-len "
                             f"{seq_len} (--sft-overlong {overlong}): use a longer --seq-len")
        self.rows = _best_fit_rows(self.lengths, seq_len)
        self.row_bounds = np.concatenate([[0], np.cumsum([len(row) for row in self.rows])])
        self.row_items = np.asarray([item for row in self.rows for item in row], dtype=np.int64)
        self.stats = {"documents": documents.num_documents, "overlong": int(overlong_b.sum()),
                      "truncated": int((overlong_b & keep).sum()) if overlong == "truncate" else 0,
                      "dropped": int((~keep).sum()), "dropped_without_label": int(no_label_left.sum()),
                      "rows": len(self.rows), "labelled_tokens": int(trained_kept[keep].sum()),
                      "fill": float(self.lengths.sum() / (len(self.rows) * seq_len))}
        s = self.stats
        logger.info("%s: %d documents -> %d packed rows of %d tokens (%.1f%% filled, %d labelled tokens); %d longer "
                    "than --seq-len (%s: %d truncated), %d dropped (%d of them with no assistant token within "
                    "--seq-len)", source, s["documents"], s["rows"], seq_len, 100 * s["fill"], s["labelled_tokens"],
                    s["overlong"], overlong, s["truncated"], s["dropped"], s["dropped_without_label"])

    def __len__(self) -> int:
        return len(self.rows)

    def micro_batch(self, indices: Sequence[int] | torch.Tensor) -> MicroBatch:
        """Rows ``indices`` stacked: inputs, labels, position ids and document ids [B, seq_len] int64."""
        indices_b = checked_sample_indices(indices, len(self))
        shape = (indices_b.size, self.seq_len)
        inputs = np.full(shape, self.pad_id, dtype=np.int64)
        labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        positions = np.tile(np.arange(self.seq_len, dtype=np.int64), (indices_b.size, 1))
        documents = np.zeros(shape, dtype=np.int64)
        ids, assistant = self.documents.ids, self.documents.assistant
        for b, row in enumerate(indices_b.tolist()):
            at = 0
            items = self.row_items[self.row_bounds[row]:self.row_bounds[row + 1]]
            for d, item in enumerate(items.tolist()):
                start, n = int(self.starts[item]), int(self.lengths[item])
                window = ids[start:start + n + 1].astype(np.int64)
                inputs[b, at:at + n] = window[:-1]
                labels[b, at:at + n] = np.where(assistant[start + 1:start + n + 1], window[1:], IGNORE_INDEX)
                positions[b, at:at + n] = np.arange(n)
                documents[b, at:at + n] = d
                at += n
            positions[b, at:] = np.arange(self.seq_len - at)
            documents[b, at:] = len(items)                 # the padding: a document of its own
        return MicroBatch(*(torch.from_numpy(a) for a in (inputs, labels, positions, documents)))

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``indices``: (inputs, labels) [B, seq_len] int64 (:meth:`micro_batch` without the document masks)."""
        batch = self.micro_batch(indices)
        return batch.inputs, batch.labels


def split_chat_documents(documents: ChatDocuments, eval_fraction: float, *, seed: int,
                         source: str = "chat data") -> tuple[ChatDocuments, ChatDocuments]:
    """(train, eval): a seeded random ``eval_fraction`` of the conversations held out, whole (all their
    documents), by :func:`megamoe.data.eval_split.held_out_split`, the rule that holds out documents (at least
    one conversation on each side; ``n - round((1 - F) * n)`` held out)."""
    n = documents.num_conversations
    if n < 2:
        raise ValueError(f"{source}: cannot hold out eval conversations from {n} conversation(s) (needs at least 2; "
                         "or give separate eval data, --eval-data)")
    kept, held_out = held_out_split(n, eval_fraction, seed=seed)
    return documents.select(kept), documents.select(held_out)
