"""A blend of sample datasets by weight, by Megatron-LM's rule, with the counts per dataset logged.

Blend position ``i`` (of ``num_samples``) goes to the dataset whose share is furthest behind its
weight: ``argmax_d weight_d * max(i, 1) - count_d`` in float64 (ties to the lowest ``d``), with
``count_d`` its picks among positions ``0 .. i - 1`` and the weights normalised by their float64 sum:
Megatron-LM's ``build_blending_indices`` (megatron/core/datasets/helpers.cpp) exactly, so the same
weights give the same dataset of every position (weights [0.3, 0.7] over 8: [1, 0, 1, 1, 0, 1, 1, 0]).
After ``n`` positions dataset ``d`` holds fewer than ``weight_d * n + 1`` samples (each pick has a
deficit >= 0) and, in every case tested, more than ``weight_d * n - 2``: positions 0 and 1 share one
target, which makes the counts lag ``weight_d * (i + 1)`` by up to one more sample than a greedy over
``i + 1`` would. Dataset ``d``'s ``k``-th sample is its sample ``order_{d,e}[k mod len_d]`` with epoch
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
from array import array
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
    # As Megatron's normalize(): float64 division by numpy's sum, so that the greedy sees the same weights.
    weights_d = np.asarray(weights, dtype=np.float64)
    return (weights_d / np.sum(weights_d)).tolist()


def _greedy_choices(weights: list[float], *, num_samples: int | None = None,
                    until_counts: Sequence[int] | None = None) -> np.ndarray:
    """The greedy rule's dataset for positions 0, 1, ... (int64): ``num_samples`` positions, or with
    ``until_counts`` the fewest after which every dataset ``d`` has ``until_counts[d]`` of them. The
    rule never looks ahead, so a shorter blend is a prefix of a longer one."""
    counts = [0] * len(weights)
    datasets = range(len(weights))
    # With until_counts: how many datasets are still below their count.
    short = 0 if until_counts is None else sum(wanted > 0 for wanted in until_counts)
    choices = array("q")
    expected = num_samples if num_samples is not None else max(
        math.ceil(wanted / weight) for wanted, weight in zip(until_counts, weights))
    with tqdm(total=expected, desc="blending", unit="sample",
              disable=None if expected > _PROGRESS_EVERY else True) as progress:
        i = 0
        while i < num_samples if num_samples is not None else short:
            target = float(max(i, 1))
            best, best_error = 0, weights[0] * target - counts[0]
            for d in datasets[1:]:
                error = weights[d] * target - counts[d]
                if error > best_error:
                    best, best_error = d, error
            counts[best] += 1
            if until_counts is not None and counts[best] == until_counts[best]:
                short -= 1
            choices.append(best)
            i += 1
            if i % _PROGRESS_EVERY == 0:
                progress.update(_PROGRESS_EVERY)
        progress.update(i % _PROGRESS_EVERY)
    return np.frombuffer(choices, dtype=np.int64).copy() if choices else np.empty(0, dtype=np.int64)


def blend_dataset_index(weights: Sequence[float], num_samples: int) -> np.ndarray:
    """The dataset of each blend position, int64 [num_samples]: the greedy rule of the module
    docstring over the normalised ``weights``."""
    if num_samples < 1:
        raise ValueError(f"BlendedDataset num_samples must be >= 1, got {num_samples}")
    return _greedy_choices(_normalised_weights(weights, len(weights)), num_samples=num_samples)


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
    """The fewest blend samples in which every dataset is seen whole at least once: the first ``n`` at
    which the greedy rule has given dataset ``d`` ``lengths[d]`` positions, for every ``d``. About
    ``max_d len_d / w_d``; the rule's lag (module docstring) can add a position or two of the weight."""
    return len(_greedy_choices(_normalised_weights(weights, len(lengths)), until_counts=lengths))


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
        self.seed = seed
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"BlendedDataset num_samples must be >= 1, got {num_samples}")
        # Without num_samples: full_pass_num_samples, without running the greedy twice. (self.weights are
        # normalised already: normalising them again could change their last bits, and so the blend.)
        self.dataset_index = (_greedy_choices(self.weights, until_counts=lengths) if num_samples is None
                              else _greedy_choices(self.weights, num_samples=num_samples))
        self.num_samples = len(self.dataset_index)
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
