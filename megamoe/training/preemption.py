"""Stopping a training run cleanly on SIGTERM (a scheduler's preemption, ``scancel``, torchrun passing on its
own SIGTERM) or SIGINT (Ctrl-C): the run saves a checkpoint at the next step boundary and ends normally
(exit code 0), and running the same command again resumes it there. Megatron's ``--exit-signal-handler``
does the same.

:class:`StopSignals` replaces the two signals' handlers, while a run trains, with one that only records
the signal: the step being computed finishes, and a signal never interrupts a checkpoint being written
(a second Ctrl-C while saving is recorded and ignored, so no half-written checkpoint is left; the save is
atomic anyway, see :func:`~megamoe.training.checkpoint.save_training_checkpoint`).

Every rank must stop at the same step (a rank that stopped alone would leave the others waiting in the
next step's collectives), but a signal may reach one rank only, or reach the ranks during different steps:
at each step boundary :meth:`StopSignals.agreed` all-reduces (MAX) each rank's "signal received" flag over
the world, and every rank stops where any rank got one. That is one all-reduce of one integer per step.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.host_values import host_ints

__all__ = ["STOP_SIGNALS", "StopSignals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager: while inside, SIGTERM and SIGINT are recorded (:attr:`received`) instead of ending
    the process; the previous handlers come back on exit. Outside the main thread (where Python cannot
    install handlers) it records nothing and the signals keep their handlers."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None     # the first signal recorded on this rank
        self.ignored = 0                                # signals after the first (e.g. while saving)
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum, frame) -> None:
        # Only a flag: a signal handler runs between two bytecodes of the main thread, which may be
        # inside a collective's wrapper or writing a checkpoint. The step boundary acts on it.
        if self.received is None:
            self.received = signal.Signals(signum)
        else:
            self.ignored += 1

    def agreed(self, group, device: torch.device) -> bool:
        """Whether any rank of ``group`` (the world; None: this process alone) received a stop signal;
        collective over ``group``: every rank calls it at the same step boundary and gets the same answer."""
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int64, device=device)
        if group is not None and dist.is_initialized():
            comms.all_reduce_(flag, group, op=dist.ReduceOp.MAX)
        return host_ints(flag, on_meta=[0])[0] > 0

    def reason(self) -> str:
        """What stopped the run, as a log line names it."""
        return self.received.name if self.received is not None else "a stop signal on another rank"
