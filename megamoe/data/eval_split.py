"""Held-out evaluation data: a train / eval split of a token dataset by documents; the eval batches of a DP rank.

``split_train_eval(dataset, F, seed=S)`` holds out ``n - round((1 - F) * n)`` of the dataset's ``n``
(non-empty) documents, at least one and at least one left to train on, chosen at random by a seeded
permutation: the same documents for the same data, ``F`` and ``S`` (a resumed run passes its ``--seed``
again, which its sampler state checks), and drawn from the whole file, so that a corpus sorted by topic
or source still gets a representative eval set. Each side is its documents' tokens back to back (training
documents in file order, eval documents in the permutation's order, so that the first eval batches are
a random sample too) cut into the same fixed-length windows as ``TokenDataset``; no document has a token
on both sides.

Megatron-LM's train/valid/test split (``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``
in megatron/core/datasets/blended_megatron_dataset_builder.py, read at commit d98e8a6 of 2026-08-22)
matches in two things: it splits by whole units, and for split weights ``(1 - F, F)`` its validation
part holds ``n - round((1 - F) * n)`` of them, the count used here. It differs in two: its unit is a
sequence (a document with ``tools/preprocess_data.py``'s default of one sequence per document; here
always a document), and its validation part is the contiguous range ``[round((1 - F) * n), n)`` in file
order, the dataset's tail; it shuffles documents and samples only inside each part. So Megatron's split
is not random: this one is, on purpose.

A separate eval dataset (any token source) is just a second ``TokenDataset``; several eval parts (one per
blended dataset) are joined by ``ConcatenatedDataset``.

``eval_batches`` visits every eval sample once, in order, and gives each DP rank the same slice of each
eval step that ``ResumableSampler`` would, so the token-weighted eval loss over all ranks does not depend
on the DP size or the micro-batch size.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import Iterator, Sequence

import numpy as np
import torch

from megamoe.data.sample_dataset import SampleDataset, checked_sample_indices, common_seq_len, gather_samples
from megamoe.data.token_dataset import TokenDataset

__all__ = ["IGNORE_INDEX", "DocumentSamples", "ConcatenatedDataset", "held_out_split", "split_train_eval",
           "eval_batches"]

# Labels the model's loss ignores (GPTMoEModel, vocab_parallel_cross_entropy): padding of the last eval step.
IGNORE_INDEX = -100


class DocumentSamples:
    """Fixed-length samples, as ``TokenDataset`` cuts them, of some documents of ``tokens`` put back to back:
    the token ranges ``[starts[k], ends[k])`` in that order. Sample ``i`` is the window ``[i * seq_len,
    i * seq_len + seq_len + 1)`` of that stream, (inputs, labels) = (window[:-1], window[1:])."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, seq_len: int):
        starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        if starts.shape != ends.shape or starts.ndim != 1 or np.any(ends < starts) or (
                starts.size and (starts.min() < 0 or ends.max() > tokens.shape[0])):
            raise ValueError(f"DocumentSamples needs ranges [start, end) inside the {tokens.shape[0]} tokens")
        # Ranges that continue one another are one range: fewer to search per token.
        follows = np.flatnonzero(starts[1:] == ends[:-1]) + 1
        keep = np.ones(starts.size, dtype=bool)
        keep[follows] = False
        self._starts = starts[keep]
        lengths = ends[np.append(keep[1:], True)] - self._starts
        self._stream_ends = np.cumsum(lengths)                       # where each range ends in the stream
        self._stream_starts = self._stream_ends - lengths
        self.num_tokens = int(self._stream_ends[-1]) if self._stream_ends.size else 0
        self.tokens, self.seq_len = tokens, seq_len
        self.num_samples = max(0, (self.num_tokens - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` stacked: (inputs [B, S], labels [B, S]), int64."""
        indices_b = checked_sample_indices(indices, self.num_samples)
        positions_bw = indices_b[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        ranges_bw = np.searchsorted(self._stream_ends, positions_bw, side="right")
        file_positions_bw = self._starts[ranges_bw] + positions_bw - self._stream_starts[ranges_bw]
        windows_bw = torch.from_numpy(self.tokens[file_positions_bw].astype(np.int64))
        return windows_bw[:, :-1].contiguous(), windows_bw[:, 1:].contiguous()


class ConcatenatedDataset:
    """``datasets`` one after the other (same ``seq_len``): e.g. the eval parts of blended datasets."""

    def __init__(self, datasets: Sequence[SampleDataset]):
        self.datasets = list(datasets)
        self.seq_len = common_seq_len(self.datasets, "ConcatenatedDataset")
        self._ends = np.cumsum([len(dataset) for dataset in self.datasets])

    def __len__(self) -> int:
        return int(self._ends[-1])

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices_b = checked_sample_indices(indices, len(self))
        datasets_b = np.searchsorted(self._ends, indices_b, side="right")
        starts = np.concatenate([[0], self._ends[:-1]])
        return gather_samples(self.datasets, self.seq_len, datasets_b, indices_b - starts[datasets_b])


def _split_seed(seed: int) -> int:
    """A 63-bit generator seed for the split; hashed so that it is unrelated to the sampler's streams."""
    digest = hashlib.sha256(f"megamoe.split_train_eval:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _check_eval_fraction(eval_fraction) -> None:
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, numbers.Real) \
            or not math.isfinite(eval_fraction) or not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be a number in (0, 1), got {eval_fraction!r}")


def held_out_split(count: int, eval_fraction: float, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out): indices of ``count`` >= 2 units, ``count - round((1 - eval_fraction) * count)`` of them
    held out (at least one, and one kept) by a seeded permutation; kept in order, held out in the
    permutation's (see the module docstring); ValueError unless ``eval_fraction`` is in (0, 1)."""
    _check_eval_fraction(eval_fraction)
    num_eval = min(count - 1, max(1, count - round((1 - eval_fraction) * count)))
    order = torch.randperm(count, generator=torch.Generator().manual_seed(_split_seed(seed))).numpy()
    return np.sort(order[num_eval:]), order[:num_eval]


def split_train_eval(dataset: TokenDataset, eval_fraction: float, *, seed: int) -> tuple[DocumentSamples,
                                                                                          DocumentSamples]:
    """(train, eval): ``dataset``'s documents split as the module docstring says; ``eval_fraction`` in
    (0, 1), e.g. ``--eval-fraction``. ValueError when the documents are unknown (a token file built
    without EOS) or too few, or when a side holds too few tokens for one sample."""
    _check_eval_fraction(eval_fraction)
    source = dataset.source
    try:
        bounds = source.document_bounds()
    except ValueError as error:
        raise ValueError(f"cannot hold out whole documents: {error}; rebuild it with an EOS after each document, "
                         "or give separate eval data (--eval-data)") from None
    starts, ends = bounds[:-1], bounds[1:]
    non_empty = ends > starts
    starts, ends = starts[non_empty], ends[non_empty]
    num_documents = starts.size
    if num_documents < 2:
        raise ValueError(f"cannot hold out eval documents from {source}: it has {num_documents} document(s) and "
                         "needs at least 2 (use more documents, or give separate eval data, --eval-data)")
    kept, held_out = held_out_split(num_documents, eval_fraction, seed=seed)
    num_eval = held_out.size
    train = DocumentSamples(source.tokens, starts[kept], ends[kept], dataset.seq_len)
    held = DocumentSamples(source.tokens, starts[held_out], ends[held_out], dataset.seq_len)
    for side, part in (("training", train), ("eval", held)):
        if len(part) < 1:
            raise ValueError(
                f"{source}: the {side} side of --eval-fraction {eval_fraction:g} ({num_eval} of {num_documents} "
                f"documents held out) has {part.num_tokens} tokens, too few for one sample of seq_len "
                f"{dataset.seq_len}: use another fraction, more data, or separate eval data (--eval-data)")
    return train, held


def eval_batches(
    dataset: SampleDataset,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_samples: int | None = None,
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """This DP rank's micro-batches (inputs [mb, S], labels [mb, S]; the :class:`~megamoe.data.packing.MicroBatch`
    of ``dataset.micro_batch`` where it has one, e.g. chat SFT rows) of each eval step, over samples
    ``0 .. num_samples - 1`` (default: all) in order.

    Step ``k`` covers samples ``[k * global_batch_size, (k + 1) * global_batch_size)``, rank ``r``
    its ``r``-th contiguous part, as in ``ResumableSampler``; every rank yields the same number of steps
    and micro-batches of the same shape (collectives and pipeline schedules stay in step). Positions
    past the last sample are padding: inputs of sample 0, labels all ``IGNORE_INDEX``. So the eval
    loss is the token-weighted mean over ranks and steps, weights ``(labels != IGNORE_INDEX).sum()``.
    """
    if global_batch_size < 1 or micro_batch_size < 1 or dp_size < 1 or global_batch_size % (dp_size * micro_batch_size):
        raise ValueError(
            f"eval_batches global_batch_size ({global_batch_size}) must be a positive multiple of dp_size * "
            f"micro_batch_size ({dp_size} * {micro_batch_size})"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"eval_batches dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
    total = len(dataset) if num_samples is None else num_samples
    if not 1 <= total <= len(dataset):
        raise ValueError(f"eval_batches num_samples must be in [1, len(dataset) = {len(dataset)}], got {num_samples}")
    per_rank = global_batch_size // dp_size
    for step_start in range(0, total, global_batch_size):
        rank_start = step_start + dp_rank * per_rank
        micro_batches = []
        for start in range(rank_start, rank_start + per_rank, micro_batch_size):
            positions = np.arange(start, start + micro_batch_size)
            valid = positions < total
            # A dataset of packed rows with their own document masks (chat SFT) gives them with its micro_batch.
            rows = getattr(dataset, "micro_batch", dataset.batch)(np.where(valid, positions, 0))
            rows[1][torch.from_numpy(~valid)] = IGNORE_INDEX
            micro_batches.append(rows)
        yield micro_batches
