"""What blends, splits and samplers need of a dataset of fixed-length samples, and the shared helpers
of datasets made of other datasets (``BlendedDataset``, ``ConcatenatedDataset``)."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

__all__ = ["SampleDataset", "common_seq_len", "checked_sample_indices", "gather_samples"]


class SampleDataset(Protocol):
    """``TokenDataset`` is one: ``len`` samples, ``batch(indices)`` -> (inputs [B, S], labels [B, S]) int64."""

    seq_len: int

    def __len__(self) -> int: ...

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def common_seq_len(datasets: Sequence[SampleDataset], owner: str) -> int:
    """The one ``seq_len`` of ``datasets``; ValueError (naming ``owner``) if empty or mixed."""
    if not datasets:
        raise ValueError(f"{owner} needs at least one dataset, got an empty list")
    seq_lens = {getattr(dataset, "seq_len", None) for dataset in datasets}
    if len(seq_lens) != 1:
        raise ValueError(f"{owner} datasets must share one seq_len, got {sorted(map(str, seq_lens))}")
    return seq_lens.pop()


def checked_sample_indices(indices: Sequence[int] | torch.Tensor, length: int) -> np.ndarray:
    """``indices`` as int64 numpy; IndexError unless 1-D and in ``[0, length)``."""
    indices_b = np.asarray(indices, dtype=np.int64)
    if indices_b.ndim != 1 or (indices_b.size and not 0 <= indices_b.min() <= indices_b.max() < length):
        raise IndexError(f"sample indices must be a 1-D sequence of ints in [0, {length})")
    return indices_b


def gather_samples(datasets: Sequence[SampleDataset], seq_len: int, datasets_b: np.ndarray,
                   local_indices_b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``b`` is sample ``local_indices_b[b]`` of ``datasets[datasets_b[b]]``: one ``batch`` call per
    dataset present. Returns (inputs [B, S], labels [B, S]) int64."""
    inputs_bs = torch.empty(datasets_b.size, seq_len, dtype=torch.int64)
    labels_bs = torch.empty_like(inputs_bs)
    for d in np.unique(datasets_b).tolist():
        rows = np.flatnonzero(datasets_b == d)
        inputs, labels = datasets[d].batch(local_indices_b[rows])
        rows = torch.from_numpy(rows)
        inputs_bs[rows], labels_bs[rows] = inputs, labels
    return inputs_bs, labels_bs
