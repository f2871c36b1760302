"""What rank 0 shows of a training run: a tqdm progress line while it trains (step, loss, tokens/s, ETA) and
a summary when it ends (steps, tokens, time, final and best eval loss, where the checkpoints are).

The progress line is drawn on stderr only where stderr is a terminal (and not with ``--no-progress``), so
that a log file or a CI capture keeps the plain ``logging`` lines; those are written either way.
"""

from __future__ import annotations

import dataclasses
import sys

from tqdm import tqdm

__all__ = ["RunSummary", "TrainingProgress"]


@dataclasses.dataclass
class RunSummary:
    """A run's totals, filled while it trains (:meth:`step`, :meth:`evaluated`, :meth:`saved`); ``seconds``
    is the wall time of the training loop (evaluation and checkpoints included)."""

    start_step: int
    end_step: int = 0
    trained_steps: int = 0
    skipped_steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    final_loss: float | None = None
    final_eval_loss: float | None = None
    best_eval_loss: float | None = None
    best_eval_step: int | None = None
    save_dir: str | None = None
    last_checkpoint: str | None = None
    exported_to: str | None = None

    def __post_init__(self):
        if self.start_step < 0:
            raise ValueError(f"RunSummary.start_step must be >= 0, got {self.start_step}")
        self.end_step = max(self.end_step, self.start_step)

    def step(self, step: int, loss: float, tokens: int, skipped: bool) -> None:
        self.end_step, self.final_loss = step, loss
        self.trained_steps += 1
        self.skipped_steps += bool(skipped)
        self.tokens += tokens

    def evaluated(self, step: int, eval_loss: float) -> None:
        self.final_eval_loss = eval_loss
        if self.best_eval_loss is None or eval_loss < self.best_eval_loss:
            self.best_eval_loss, self.best_eval_step = eval_loss, step

    def saved(self, path: str) -> None:
        self.last_checkpoint = path

    def lines(self) -> list[str]:
        """The summary, one fact per line."""
        if not self.trained_steps:
            trained = f"no step trained (the run was at step {self.start_step} already)"
        else:
            skipped = f", {self.skipped_steps} skipped (non-finite)" if self.skipped_steps else ""
            steps = (f"step {self.end_step}" if self.end_step == self.start_step + 1 else
                     f"steps {self.start_step + 1}-{self.end_step}")
            trained = (f"{steps} ({self.trained_steps} trained{skipped}), "
                       f"{self.tokens:,} tokens in {self.seconds:.1f} s "
                       f"({self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s)")
        lines = [f"run summary: {trained}"]
        if self.final_loss is not None:
            lines.append(f"  final training loss {self.final_loss:.4f}")
        if self.final_eval_loss is not None:
            lines.append(f"  eval loss: final {self.final_eval_loss:.4f}, best {self.best_eval_loss:.4f} "
                         f"(step {self.best_eval_step})")
        else:
            lines.append("  eval loss: not evaluated (no held-out data: --eval-fraction / --eval-data)")
        lines.append(f"  checkpoints in {self.save_dir}" + (f", newest {self.last_checkpoint}"
                                                             if self.last_checkpoint else ", none written"))
        if self.exported_to is not None:
            lines.append(f"  exported as a HuggingFace model to {self.exported_to}")
        return lines


class TrainingProgress:
    """The progress line of rank 0 (a no-op elsewhere, without a terminal, or when ``enabled`` is False)."""

    def __init__(self, *, start_step: int, end_step: int, enabled: bool, rank: int, stream=None):
        stream = stream if stream is not None else sys.stderr
        shown = enabled and rank == 0 and end_step > start_step and stream.isatty()
        self._bar = tqdm(total=end_step, initial=start_step, desc="train", unit="step", file=stream,
                         dynamic_ncols=True) if shown else None

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s", refresh=False)
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
