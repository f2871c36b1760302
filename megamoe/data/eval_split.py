"""Held-out evaluation data: a train / eval split of a dataset, and the eval batches of a DP rank.

``split_train_eval(dataset, F)`` holds out the dataset's last ``round(F * len)`` samples (at least one,
and at least one left to train on). A contiguous tail, not a random subset: samples are consecutive
windows of one token stream, so a random subset would put neighbours of every eval sample (often the
same document) in training; with a tail only the one document at the cut is shared, and no eval label
is ever a training input or label. A separate eval dataset (any token source) is just a second
``TokenDataset``; several eval parts (one per blended dataset) are joined by ``ConcatenatedDataset``.

``eval_batches`` visits every eval sample once, in order, and gives each DP rank the same slice of each
eval step that ``ResumableSampler`` would, so the token-weighted eval loss over all ranks does not depend
on the DP size or the micro-batch size.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterator, Sequence

import numpy as np
import torch

from megamoe.data.sample_dataset import SampleDataset, checked_sample_indices, common_seq_len, gather_samples

__all__ = ["IGNORE_INDEX", "SampleRange", "ConcatenatedDataset", "split_train_eval", "eval_batches"]

# Labels the model's loss ignores (GPTMoEModel, vocab_parallel_cross_entropy): padding of the last eval step.
IGNORE_INDEX = -100


class SampleRange:
    """Samples ``[start, stop)`` of ``dataset`` as a dataset of their own (index 0 is ``start``)."""

    def __init__(self, dataset: SampleDataset, start: int, stop: int):
        if not 0 <= start < stop <= len(dataset):
            raise ValueError(f"SampleRange needs 0 <= start < stop <= len(dataset) = {len(dataset)}, got "
                             f"[{start}, {stop})")
        self.dataset, self.start, self.stop = dataset, start, stop
        self.seq_len = dataset.seq_len

    def __len__(self) -> int:
        return self.stop - self.start

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.batch(checked_sample_indices(indices, len(self)) + self.start)


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


def split_train_eval(dataset: SampleDataset, eval_fraction: float) -> tuple[SampleRange, SampleRange]:
    """(train, eval): the first samples and the held-out tail of ``dataset`` (module docstring);
    ``eval_fraction`` in (0, 1), e.g. ``--eval-fraction``."""
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, numbers.Real) \
            or not math.isfinite(eval_fraction) or not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be a number in (0, 1), got {eval_fraction!r}")
    num_samples = len(dataset)
    if num_samples < 2:
        raise ValueError(f"cannot hold out eval samples from a dataset of {num_samples} sample(s): it needs at "
                         "least 2 (use more data, a shorter seq_len, or a separate eval dataset)")
    num_eval = min(num_samples - 1, max(1, round(eval_fraction * num_samples)))
    cut = num_samples - num_eval
    return SampleRange(dataset, 0, cut), SampleRange(dataset, cut, num_samples)


def eval_batches(
    dataset: SampleDataset,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_samples: int | None = None,
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """This DP rank's micro-batches (inputs [mb, S], labels [mb, S]) of each eval step, over samples
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
            inputs, labels = dataset.batch(np.where(valid, positions, 0))
            labels[torch.from_numpy(~valid)] = IGNORE_INDEX
            micro_batches.append((inputs, labels))
        yield micro_batches
