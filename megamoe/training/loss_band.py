"""How far a bf16 training run's loss curve strays from the fp32 run's on the same batches (issue 33).

:func:`train_losses` trains a model with the :class:`~megamoe.training.trainer.Trainer` on given global
batches and returns the loss per step; :func:`loss_band` compares two such curves. Per-step losses of a
small batch jump by more than bf16's rounding moves them, so the band is taken on window means: the largest
relative difference between the means of ``window`` consecutive steps (and the final window's, which says
whether the runs end at the same loss). benchmarks/bf16_loss_band.py measures it on the demo model over 200
steps; tests/test_bf16_loss_band.py checks a short run against a bound derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from megamoe.training.trainer import TrainConfig, Trainer
from parallel_state import ParallelState

__all__ = ["LossBand", "loss_band", "train_losses"]


@dataclass(frozen=True)
class LossBand:
    """``max_rel``: the largest |mean(other) - mean(reference)| / mean(reference) over windows of ``window``
    steps; ``final_rel``: that of the last window; ``max_step_rel``: the largest per-step relative difference."""

    steps: int
    window: int
    max_rel: float
    final_rel: float
    max_step_rel: float


def loss_band(reference: Sequence[float], other: Sequence[float], *, window: int = 10) -> LossBand:
    """The band of ``other``'s loss curve around ``reference``'s (same steps, same batches)."""
    if len(reference) != len(other) or not reference:
        raise ValueError(f"loss_band: curves must be non-empty and equally long, got {len(reference)} and "
                         f"{len(other)} steps")
    if not 1 <= window <= len(reference):
        raise ValueError(f"loss_band: window must be in [1, {len(reference)}], got {window}")
    ref, oth = torch.tensor(reference, dtype=torch.float64), torch.tensor(other, dtype=torch.float64)
    if not bool(torch.isfinite(ref).all() and torch.isfinite(oth).all()) or not bool((ref > 0).all()):
        raise ValueError("loss_band: losses must be finite, the reference's positive")
    ref_means, oth_means = ref.unfold(0, window, 1).mean(-1), oth.unfold(0, window, 1).mean(-1)
    rel = (oth_means - ref_means).abs() / ref_means
    return LossBand(steps=len(reference), window=window, max_rel=float(rel.max()), final_rel=float(rel[-1]),
                    max_step_rel=float(((oth - ref).abs() / ref).max()))


def train_losses(model: nn.Module, batches: Iterable[torch.Tensor], config: TrainConfig, *,
                 micro_batch: int) -> list[float]:
    """The loss per step of ``model`` (one process) trained with ``config`` on ``batches`` (global batches
    [B, S + 1] of token ids, split into micro-batches of ``micro_batch`` sequences). bf16 parameters train
    with fp32 master weights and fp32 gradient accumulation (the Trainer's main_grad path)."""
    trainer = Trainer(model, ParallelState.single_process(), config)
    losses = []
    for batch in batches:
        losses.append(trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(micro_batch)]).loss)
    return losses
