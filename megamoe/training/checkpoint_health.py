"""Whether a checkpoint about to be saved is good: the run's state against its last good checkpoint's.

A save refuses NaN and Inf (:func:`megamoe.training.checkpoint.save_training_checkpoint`), but finite is not
enough: a run resumed with a learning rate of 1e30 takes one update to weights around 1e30 (finite), and
every later step is skipped as non-finite. Its checkpoints must not count as good, or pruning removes the
good ones and the advice to "resume from an earlier checkpoint" names one that no longer exists.

:class:`HealthMonitor` follows a run's steps and, at each save, compares the run with the last good
checkpoint's :class:`Health` (recorded in its manifest as ``extra.health``). The save is suspect when:

- a step was skipped as non-finite since the last good save (an fp16 step whose loss is finite but whose
  gradients overflowed is not counted: it only lowers the loss scale, as dynamic loss scaling does);
- the weight norm is not finite (its square overflows: weights around 1e30 in fp32), or grew more than
  :data:`WEIGHT_NORM_GROWTH` times;
- the mean loss of the (finite) steps since the previous save rose above :data:`LOSS_RISE` times the
  good one's (plus one nat, for small losses);
- the largest grad norm of those steps grew more than :data:`GRAD_NORM_GROWTH` times.

The bounds are loose on purpose (a legitimate loss spike or a change of data must not make every later
checkpoint suspect); a diverged run exceeds them by orders of magnitude. A suspect checkpoint is still
saved (it is the evidence), marked ``suspect`` with the reason; pruning keeps the newest good one
(:func:`megamoe.training.checkpoint.prune_checkpoints`), and the comparison stays against that one until
a save is good again.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from megamoe.checkpoint.format import read_manifest
from megamoe.training.checkpoint import is_good_checkpoint, last_good_checkpoint

__all__ = ["Health", "HealthMonitor", "WEIGHT_NORM_GROWTH", "LOSS_RISE", "GRAD_NORM_GROWTH"]

# Loose on purpose (see above): grad norms of a healthy run spike tenfold now and then, and a diverged
# run exceeds these by factors of 1e10 and more (lr 1e30: a weight norm that overflows to inf).
WEIGHT_NORM_GROWTH = 10.0
LOSS_RISE = 2.0
GRAD_NORM_GROWTH = 100.0


@dataclass(frozen=True)
class Health:
    """The run at a save: the mean loss and the largest grad norm of the finite steps since the previous
    save (NaN: none was finite), the weight norm (:func:`megamoe.training.grad_sync.global_param_norm`),
    the steps skipped as non-finite since the last good save, and ``suspect``: why the save is not good
    (None: it is)."""

    loss: float
    grad_norm: float
    weight_norm: float
    skipped_steps: int
    suspect: str | None = None

    def to_dict(self) -> dict:
        # JSON has no NaN or Infinity: a non-finite value is recorded as None.
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data) -> "Health | None":
        """The health a manifest records (None when it records none, or not in this form)."""
        if not isinstance(data, dict):
            return None
        try:
            values = [float("nan") if data.get(k) is None else float(data[k])
                      for k in ("loss", "grad_norm", "weight_norm")]
            skipped = int(data.get("skipped_steps") or 0)
        except (TypeError, ValueError):
            return None
        suspect = data.get("suspect")
        return cls(*values, skipped, suspect if isinstance(suspect, str) else None)


class HealthMonitor:
    """Feed it every step (:meth:`record`); at a save, :meth:`judge` says what to record, and
    :meth:`saved` moves the reference on to a good save. ``reference``: the health of the last good
    checkpoint (None: none to compare with, e.g. a fresh run), ``reference_path`` where it is."""

    def __init__(self, reference: Health | None = None, reference_path: str | None = None):
        self.reference, self.reference_path = reference, reference_path
        self.skipped_since_good = 0
        self._losses: list[float] = []
        self._grad_norms: list[float] = []

    @classmethod
    def resuming(cls, path: str | None) -> "HealthMonitor":
        """The monitor of a run that starts from the checkpoint ``path`` (None: fresh weights): its
        reference is ``path`` when good, else the newest good checkpoint before it in its directory; a run
        resuming a suspect checkpoint carries on its count of skipped steps."""
        if path is None:
            return cls()
        extra = read_manifest(path).get("extra") or {}
        if is_good_checkpoint(extra):
            return cls(Health.from_dict(extra.get("health")), path)
        step = extra.get("step") if isinstance(extra.get("step"), int) else None
        good = last_good_checkpoint(os.path.dirname(os.path.normpath(path)), before_step=step)
        reference = Health.from_dict((read_manifest(good).get("extra") or {}).get("health")) if good else None
        monitor = cls(reference, good)
        resumed = Health.from_dict(extra.get("health"))
        monitor.skipped_since_good = resumed.skipped_steps if resumed is not None else 0
        return monitor

    def rollback_advice(self) -> str:
        """Where to go back to: the last good checkpoint, as an error message's last sentence."""
        if self.reference_path is None:
            return "This run saved no good checkpoint to go back to."
        return (f"The last good checkpoint is {self.reference_path}: resume from it (--load-dir "
                f"{self.reference_path}), e.g. with a lower learning rate.")

    def record(self, metrics) -> None:
        """One step's :class:`~megamoe.training.trainer.StepMetrics`."""
        if not metrics.skipped:
            self._losses.append(metrics.loss)
            self._grad_norms.append(metrics.grad_norm)
        elif not (metrics.loss_scale is not None and math.isfinite(metrics.loss)):
            self.skipped_since_good += 1

    def judge(self, weight_norm: float) -> Health:
        """The health of a save now, with ``suspect`` set when it is not good (see the module docstring)."""
        loss = sum(self._losses) / len(self._losses) if self._losses else float("nan")
        grad_norm = max(self._grad_norms) if self._grad_norms else float("nan")
        problems = []
        if self.skipped_since_good:
            problems.append(f"{self.skipped_since_good} step(s) skipped as non-finite since the last good checkpoint")
        ref = self.reference
        if not math.isfinite(weight_norm):
            problems.append(f"weight norm {weight_norm}")
        elif ref is not None and math.isfinite(ref.weight_norm) and weight_norm > WEIGHT_NORM_GROWTH * ref.weight_norm:
            problems.append(f"weight norm {weight_norm:.4g}, more than {WEIGHT_NORM_GROWTH:g}x the last good "
                            f"checkpoint's {ref.weight_norm:.4g}")
        # The steps recorded are the finite ones (a non-finite step is skipped): loss and grad norm are
        # finite, or NaN when no step was (then the skips above say it).
        if ref is not None and math.isfinite(ref.loss) and loss > LOSS_RISE * ref.loss + 1.0:
            problems.append(f"mean loss {loss:.4g}, more than {LOSS_RISE:g}x the last good checkpoint's "
                            f"{ref.loss:.4g} (+1)")
        if (ref is not None and math.isfinite(ref.grad_norm) and ref.grad_norm > 0
                and grad_norm > GRAD_NORM_GROWTH * ref.grad_norm):
            problems.append(f"grad norm {grad_norm:.4g}, more than {GRAD_NORM_GROWTH:g}x the last good "
                            f"checkpoint's {ref.grad_norm:.4g}")
        return Health(loss, grad_norm, weight_norm, self.skipped_since_good, "; ".join(problems) or None)

    def saved(self, health: Health, path: str) -> None:
        """A checkpoint with ``health`` (from :meth:`judge`) was saved at ``path``: a good one becomes the
        reference; either way the next save judges the steps after this one."""
        if health.suspect is None:
            self.reference, self.reference_path, self.skipped_since_good = health, path, 0
        self._losses, self._grad_norms = [], []
