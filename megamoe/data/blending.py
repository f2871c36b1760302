"""A Megatron-style blend of sample datasets by weight, with exact per-dataset counts.

Blend position ``i`` (of ``num_samples``) goes to the dataset whose share is furthest behind its
weight: ``argmax_d weight_d * (i + 1) - count_d`` (ties to the lowest ``d``), as Megatron-LM's
``BlendedDataset`` does; so after ``n`` positions each dataset has ``weight_d * n`` samples to within
one. Dataset ``d``'s ``k``-th sample is its sample ``order_{d,e}[k mod len_d]`` with epoch
``e = k // len_d`` and ``order_{d,e}`` a permutation seeded by ``(seed, d, e)``: a dataset asked for
more samples than it has is repeated, each pass in its own order, and one asked for fewer gives a
seeded subset rather than its first documents. The blend is a dataset like ``TokenDataset``
(``len``, ``batch(indices)``), so ``ResumableSampler`` shuffles and resumes it unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
from fractions import Fraction
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from megamoe.data.sample_dataset import SampleDataset, checked_sample_indices, common_seq_len, gather_samples

__all__ = ["BlendedDataset", "blend_dataset_index", "full_pass_num_samples"]

logger = logging.getLogger(__name__)

_PROGRESS_EVERY = 1 << 16


def _normalised_weights(weights: Sequence[float], num_datasets: int) -> list[float]:
    weights = list(weights)
    if num_datasets == 0:
        raise ValueError("BlendedDataset needs at least one dataset (and weight), got an empty list")
    if len(weights) != num_datasets:
        raise ValueError(f"BlendedDataset weights: {len(weights)} weights for {num_datasets} datasets; give one "
                         "weight per dataset")
    for d, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight) \
                or weight <= 0:
            raise ValueError(f"BlendedDataset weights[{d}] must be a positive finite number, got {weight!r}")
    total = math.fsum(weights)
    return [float(weight) / total for weight in weights]


def blend_dataset_index(weights: Sequence[float], num_samples: int) -> np.ndarray:
    """The dataset of each blend position, int64 [num_samples]: the greedy rule of the module
    docstring over the normalised ``weights``."""
    if num_samples < 1:
        raise ValueError(f"BlendedDataset num_samples must be >= 1, got {num_samples}")
    weights = _normalised_weights(weights, len(weights))
    choice = np.empty(num_samples, dtype=np.int64)
    counts = [0] * len(weights)
    datasets = range(len(weights))
    with tqdm(total=num_samples, desc="blending", unit="sample", disable=None if num_samples > _PROGRESS_EVERY
              else True) as progress:
        for i in range(num_samples):
            position = i + 1
            best, best_error = 0, weights[0] * position - counts[0]
            for d in datasets[1:]:
                error = weights[d] * position - counts[d]
                if error > best_error:
                    best, best_error = d, error
            counts[best] += 1
            choice[i] = best
            if position % _PROGRESS_EVERY == 0:
                progress.update(_PROGRESS_EVERY)
        progress.update(num_samples % _PROGRESS_EVERY)
    return choice


def _pass_seed(seed: int, dataset: int, epoch: int) -> int:
    """A 63-bit generator seed per (seed, dataset, pass); hashed so that nearby triples are unrelated."""
    digest = hashlib.sha256(f"megamoe.BlendedDataset:{seed}:{dataset}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _repeated_order(length: int, count: int, seed: int, dataset: int) -> np.ndarray:
    """The first ``count`` entries of dataset ``dataset``'s passes, each a seeded permutation of ``range(length)``."""
    passes = [torch.randperm(length, generator=torch.Generator().manual_seed(_pass_seed(seed, dataset, epoch))).numpy()
              for epoch in range(-(-count // length))]
    return np.concatenate(passes)[:count] if passes else np.empty(0, dtype=np.int64)


def full_pass_num_samples(lengths: Sequence[int], weights: Sequence[float]) -> int:
    """The fewest blend samples in which every dataset is seen whole at least once:
    ``max_d ceil(len_d / w_d)`` in exact arithmetic (so the datasets' total when weights are their lengths)."""
    total = sum(Fraction(weight) for weight in weights)
    return max(math.ceil(Fraction(length) * total / Fraction(weight)) for length, weight in zip(lengths, weights))


class BlendedDataset:
    """``num_samples`` samples drawn from ``datasets`` by ``weights`` (positive, normalised here); the
    rule is in the module docstring.

    ``num_samples`` defaults to ``full_pass_num_samples``: every dataset is seen whole at least once (the
    one shortest for its weight about once), the others repeated to their weights; the size does not
    depend on the run's length (a run resumed with more steps keeps its sampler order). A run may pass
    ``steps * global_batch_size`` instead, to honour the weights exactly over the whole run.

    ``dataset_sample_counts[d]`` is how many of the ``num_samples`` come from dataset ``d`` (logged).
    """

    def __init__(self, datasets: Sequence[SampleDataset], weights: Sequence[float], *,
                 num_samples: int | None = None, seed: int = 0):
        self.datasets = list(datasets)
        self.weights = _normalised_weights(weights, len(self.datasets))
        self.seq_len = common_seq_len(self.datasets, "BlendedDataset")
        lengths = [len(dataset) for dataset in self.datasets]
        for d, length in enumerate(lengths):
            if length < 1:
                raise ValueError(f"BlendedDataset datasets[{d}] is empty")
        self.num_samples = full_pass_num_samples(lengths, weights) if num_samples is None else num_samples
        self.seed = seed

        self.dataset_index = blend_dataset_index(self.weights, self.num_samples)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        self.dataset_sample_index = np.empty(self.num_samples, dtype=np.int64)
        for d, (length, count) in enumerate(zip(lengths, counts.tolist())):
            self.dataset_sample_index[self.dataset_index == d] = _repeated_order(length, count, seed, d)
        self._counts = tuple(counts.tolist())
        for d, (count, length, weight) in enumerate(zip(self._counts, lengths, self.weights)):
            logger.info("blend dataset %d: %d of %d samples (weight %.4f; %d samples, %.2f passes)", d, count,
                        self.num_samples, weight, length, count / length)

    @property
    def dataset_sample_counts(self) -> tuple[int, ...]:
        return self._counts

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blend samples ``indices`` stacked: (inputs [B, S], labels [B, S]), int64."""
        indices_b = checked_sample_indices(indices, self.num_samples)
        return gather_samples(self.datasets, self.seq_len, self.dataset_index[indices_b],
                              self.dataset_sample_index[indices_b])
