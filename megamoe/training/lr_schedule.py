"""Learning-rate schedules: constant, linear, cosine and WSD (warmup-stable-decay), each after a linear warmup.

The definitions are those of Megatron-LM's ``OptimizerParamScheduler`` (``--lr-decay-style``,
``--lr-wsd-decay-style``), with the minimum LR given as a ratio of the peak (``min_lr_ratio``):

- warmup, steps ``1..warmup_steps``: ``peak * step / warmup_steps`` (the last warmup step reaches the peak);
- then, with ``r = (step - warmup_steps) / (decay_steps - warmup_steps)`` and ``min = min_lr_ratio * peak``:
  ``constant``: the peak, forever (no minimum); ``linear``: ``min + (peak - min) * (1 - r)``;
  ``cosine``: ``min + (peak - min) * (1 + cos(pi r)) / 2``;
  ``wsd``: the peak until ``decay_steps - wsd_decay_steps``, then over the last ``wsd_decay_steps`` steps
  down to ``min`` in the shape ``wsd_decay_style`` of ``q``, the fraction of that decay done:
  ``linear`` ``1 - q``, ``cosine`` ``(1 + cos(pi q)) / 2``, ``exponential`` ``2 * 0.5**q - 1``,
  ``minus_sqrt`` ``1 - sqrt(q)``;
- after ``decay_steps``: ``min`` (every style but constant).

Steps count from 1: ``step`` is the number of the optimizer step the LR is for, so the first step already
trains (Megatron's first iteration runs at its ``init_lr``, 0 by default). Skipped (non-finite) steps are
not optimizer steps: the trainer does not advance the schedule on them (``Trainer.lr_schedule_steps``), as
Megatron's ``train_step`` steps its ``OptimizerParamScheduler`` only on a successful update; so
``StepMetrics.step`` runs ahead of the schedule by the steps skipped, and with ``decay_steps`` set to the
run's length a run that skipped steps ends before the end of its decay, as in Megatron. The LR is a pure
function of that count, which checkpoints save, so a resumed run continues the schedule exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["LRScheduleConfig", "LR_SCHEDULE_STYLES", "WSD_DECAY_STYLES"]

LR_SCHEDULE_STYLES = ("constant", "linear", "cosine", "wsd")
WSD_DECAY_STYLES = {
    "linear": lambda q: 1.0 - q,
    "cosine": lambda q: 0.5 * (1.0 + math.cos(math.pi * q)),
    "exponential": lambda q: 2.0 * 0.5 ** q - 1.0,
    "minus_sqrt": lambda q: 1.0 - math.sqrt(q),
}


@dataclass(frozen=True)
class LRScheduleConfig:
    """How the LR moves around the peak ``TrainConfig.lr`` over the run (see the module docstring).

    ``decay_steps``: the step at which the decay ends (counted from the start, warmup included: Megatron's
    ``--lr-decay-iters``, usually the run's length); required by every style but ``constant``.
    ``wsd_decay_steps`` or ``wsd_decay_fraction`` (of ``decay_steps``; exactly one, style ``wsd`` only):
    the length of WSD's final decay (Megatron's ``--lr-wsd-decay-iters``).
    """

    style: str = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_lr_ratio: float = 0.0
    wsd_decay_style: str = "linear"
    wsd_decay_steps: int | None = None
    wsd_decay_fraction: float | None = None

    def __post_init__(self):
        if self.style not in LR_SCHEDULE_STYLES:
            raise ValueError(f"LRScheduleConfig.style must be one of {list(LR_SCHEDULE_STYLES)}, got {self.style!r}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ValueError(f"LRScheduleConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"LRScheduleConfig.min_lr_ratio must be in [0, 1] (a fraction of the peak LR), "
                             f"got {self.min_lr_ratio}")
        if self.style != "constant":
            if not (isinstance(self.decay_steps, int) and self.decay_steps > self.warmup_steps):
                raise ValueError(f"LRScheduleConfig.decay_steps must be an int > warmup_steps ({self.warmup_steps}) "
                                 f"for style {self.style!r} (the step the decay ends at, usually the run's length), "
                                 f"got {self.decay_steps!r}")
        if self.style != "wsd":
            for name in ("wsd_decay_steps", "wsd_decay_fraction"):
                if getattr(self, name) is not None:
                    raise ValueError(f"LRScheduleConfig.{name} applies to style 'wsd' only, not {self.style!r}")
            return
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"LRScheduleConfig.wsd_decay_style must be one of {list(WSD_DECAY_STYLES)}, "
                             f"got {self.wsd_decay_style!r}")
        if (self.wsd_decay_steps is None) == (self.wsd_decay_fraction is None):
            raise ValueError("LRScheduleConfig: style 'wsd' needs exactly one of wsd_decay_steps and "
                             "wsd_decay_fraction (the length of the final decay)")
        if self.wsd_decay_fraction is not None and not 0.0 < self.wsd_decay_fraction <= 1.0:
            raise ValueError(f"LRScheduleConfig.wsd_decay_fraction must be in (0, 1], got {self.wsd_decay_fraction}")
        if self.wsd_decay_steps is not None and not (isinstance(self.wsd_decay_steps, int)
                                                     and self.wsd_decay_steps > 0):
            raise ValueError(f"LRScheduleConfig.wsd_decay_steps must be an int > 0, got {self.wsd_decay_steps!r}")
        if not 0 < self.wsd_steps() <= self.decay_steps - self.warmup_steps:
            raise ValueError(f"LRScheduleConfig: the WSD decay ({self.wsd_steps()} steps) must fit between the "
                             f"warmup ({self.warmup_steps} steps) and decay_steps ({self.decay_steps}): lower "
                             "wsd_decay_steps / wsd_decay_fraction or warmup_steps")

    def wsd_steps(self) -> int:
        """The length of WSD's final decay, in steps."""
        if self.wsd_decay_steps is not None:
            return self.wsd_decay_steps
        return round(self.wsd_decay_fraction * self.decay_steps)

    def lr_at(self, step: int, peak_lr: float) -> float:
        """The LR of optimizer step ``step`` (1-based) for the peak ``peak_lr``."""
        if step < 1:
            raise ValueError(f"LR schedule steps count from 1, got {step}")
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return peak_lr * step / self.warmup_steps
        if self.style == "constant":
            return peak_lr
        min_lr = self.min_lr_ratio * peak_lr
        if step > self.decay_steps:
            return min_lr
        if self.style == "wsd":
            decay_start = self.decay_steps - self.wsd_steps()
            if step <= decay_start:
                coeff = 1.0
            else:
                coeff = WSD_DECAY_STYLES[self.wsd_decay_style]((step - decay_start) / self.wsd_steps())
        else:
            ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
            coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
        return min_lr + coeff * (peak_lr - min_lr)

    def to_dict(self) -> dict:
        return asdict(self)
