"""Dynamic loss scaling for fp16 autocast, with ``torch.amp.GradScaler``'s rule and Megatron's lower bound.

fp16 gradients underflow below ~6e-8: the backward starts from ``loss * scale`` and the gradients are
divided by ``scale`` before clipping and the optimizer step. A step whose (globally reduced) gradient
norm or loss is not finite overflowed: it is skipped and the scale multiplied by ``backoff_factor``, but
never below ``min_scale`` (Megatron-Core's ``DynamicGradScaler.update``,
megatron/core/optimizer/grad_scaler.py, and its ``--min-loss-scale``, 1 by default; without its
hysteresis: every overflow backs off, as in ``GradScaler``); after ``growth_interval`` consecutive good
steps the scale is multiplied by ``growth_factor``. The decision uses values every rank holds identically
(the global gradient norm, the reduced loss), so every rank keeps the same scale without a collective of
its own.

An overflow that lowered the scale is calibration, not divergence: a high initial scale (Megatron's
default is 2**32) overflows for the first steps until the scale fits the gradients (12 for the tiny
model of tests/unit/test_nonfinite.py).
:meth:`DynamicLossScaler.update` says whether it lowered the scale; the trainer does not count such a
skip toward ``TrainConfig.max_skipped_steps`` (see :mod:`megamoe.training.trainer`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LossScaleConfig", "DynamicLossScaler"]


@dataclass(frozen=True)
class LossScaleConfig:
    """``torch.amp.GradScaler``'s defaults; ``min_scale`` is Megatron's ``--min-loss-scale`` default."""

    initial_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0

    def __post_init__(self):
        if not 0 < self.initial_scale < math.inf:     # inf would overflow, and back off, forever
            raise ValueError(f"LossScaleConfig.initial_scale must be a finite number > 0, got {self.initial_scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"LossScaleConfig.growth_factor must be > 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"LossScaleConfig.backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(f"LossScaleConfig.growth_interval must be an int >= 1, got {self.growth_interval!r}")
        if not 0.0 < self.min_scale <= self.initial_scale:
            raise ValueError(f"LossScaleConfig.min_scale must be > 0 and at most initial_scale "
                             f"({self.initial_scale:g}), got {self.min_scale:g}")


class DynamicLossScaler:
    """The current ``scale`` and the count of good steps since it last changed."""

    def __init__(self, config: LossScaleConfig):
        self.config = config
        self.scale = float(config.initial_scale)
        self.good_steps = 0

    def update(self, finite: bool) -> bool:
        """After a step: back off on an overflow (down to ``min_scale``), grow after ``growth_interval``
        good steps in a row. Returns whether the scale was lowered: an overflow above ``min_scale``."""
        if not finite:
            lowered = self.scale > self.config.min_scale
            self.scale = max(self.scale * self.config.backoff_factor, self.config.min_scale)
            self.good_steps = 0
            return lowered
        self.good_steps += 1
        if self.good_steps == self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.good_steps = 0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
