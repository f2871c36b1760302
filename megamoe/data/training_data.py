"""The training and eval datasets of a run, from the user's data paths: what a training script calls.

``--data-path`` follows Megatron-LM's syntax: one or more token sources (megamoe token files or
Megatron dataset prefixes), optionally each preceded by its weight (``0.3 corpus_a 0.7 corpus_b``).
Several sources are blended (:class:`~megamoe.data.blending.BlendedDataset`); without weights each
weighs its number of samples, so a pass of the blend is a pass of every source. Held-out eval data is
either the tail of every source (``eval_fraction``, split before blending so that no eval sample is
also drawn for training) or separate sources (``eval_paths``, concatenated).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megamoe.data.blending import BlendedDataset
from megamoe.data.eval_split import ConcatenatedDataset, split_train_eval
from megamoe.data.sample_dataset import SampleDataset
from megamoe.data.token_dataset import TokenDataset

__all__ = ["parse_data_paths", "TrainEvalData", "build_train_eval_data"]

logger = logging.getLogger(__name__)


def _weight(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value


def parse_data_paths(values: Sequence[str], *, flag: str = "--data-path") -> tuple[list[Path], list[float] | None]:
    """``(paths, weights)`` of ``[PATH ...]`` or ``[WEIGHT PATH ...]``; weights None when not given.
    ValueError names ``flag`` and the offending item."""
    values = [os.fspath(value) for value in values]
    if not values:
        raise ValueError(f"{flag} needs at least one token file or Megatron dataset prefix")
    if _weight(values[0]) is None:
        numbers = [value for value in values if _weight(value) is not None]
        if numbers:
            raise ValueError(f"{flag} mixes paths and weights ({numbers[0]!r}): give WEIGHT PATH pairs for every "
                             "source, or paths only")
        return [Path(value) for value in values], None
    if len(values) % 2:
        raise ValueError(f"{flag} with weights needs WEIGHT PATH pairs, got {len(values)} values")
    weights, paths = values[0::2], values[1::2]
    for weight, path in zip(weights, paths):
        number = _weight(weight)
        if number is None or not math.isfinite(number) or number <= 0:
            raise ValueError(f"{flag} weight {weight!r} (of {path}) must be a positive number")
        if _weight(path) is not None:
            raise ValueError(f"{flag} expected a path after weight {weight!r}, got the number {path!r}")
    return [Path(path) for path in paths], [float(weight) for weight in weights]


@dataclass(frozen=True)
class TrainEvalData:
    """``train`` for ``ResumableSampler`` + ``batch``; ``eval`` (None without eval data) for ``eval_batches``;
    ``sources`` the opened token datasets, in ``--data-path`` order."""

    train: SampleDataset
    eval: SampleDataset | None
    sources: tuple[TokenDataset, ...]


def build_train_eval_data(
    data_paths: Sequence[str],
    *,
    seq_len: int,
    vocab_size: int | None,
    num_samples: int | None = None,
    eval_fraction: float | None = None,
    eval_paths: Sequence[str] = (),
    seed: int = 0,
) -> TrainEvalData:
    """Open ``data_paths`` (``parse_data_paths`` syntax) as ``TokenDataset``\\ s checked against the model's
    ``vocab_size``; hold out eval data; blend several sources into ``num_samples`` samples (default:
    ``full_pass_num_samples``, every source seen whole; ``seed`` orders each source's passes). One source
    without a weight is used as is, not blended."""
    if eval_fraction is not None and eval_paths:
        raise ValueError("give eval_fraction (--eval-fraction) or eval_paths (--eval-data-path), not both")
    paths, weights = parse_data_paths(data_paths)
    sources = tuple(TokenDataset(path, seq_len, vocab_size=vocab_size) for path in paths)
    if eval_fraction is not None:
        splits = [split_train_eval(source, eval_fraction) for source in sources]
        train_parts, eval_parts = [train for train, _ in splits], [held_out for _, held_out in splits]
    else:
        train_parts = list(sources)
        eval_parts = [TokenDataset(path, seq_len, vocab_size=vocab_size)
                      for path in parse_data_paths(eval_paths, flag="--eval-data-path")[0]] if eval_paths else []
    if len(train_parts) == 1 and weights is None:
        train = train_parts[0]
    else:
        train = BlendedDataset(train_parts, weights or [len(part) for part in train_parts],
                               num_samples=num_samples, seed=seed)
    held_out = None if not eval_parts else eval_parts[0] if len(eval_parts) == 1 else ConcatenatedDataset(eval_parts)
    logger.info("training data: %d samples of %d tokens from %d source(s); eval: %s", len(train), seq_len,
                len(sources), f"{len(held_out)} samples" if held_out is not None else "none")
    return TrainEvalData(train=train, eval=held_out, sources=sources)
