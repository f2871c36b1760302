"""The host-side watchdog of collectives that run on a device stream (NCCL): a stuck peer ends the job
with :class:`~megamoe.collective_timeout.CollectiveTimeout`'s one-line diagnosis, as on gloo.

Why it is needed: on gloo a collective blocks the host and raises gloo's timeout error in the calling
thread, which :mod:`megamoe.comms` turns into a CollectiveTimeout. On NCCL the call and its ``wait()``
return at once (the current stream waits for the NCCL stream), so a stuck peer surfaces later as a host
read (``.item()``, a copy to the host, a stream synchronisation) that never returns, inside CUDA where no
Python exception reaches it. NCCL's own watchdog thread (ProcessGroupNCCL) then takes the process down
after the process group's timeout: ``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..,
OpType=ALLREDUCE, ..)``, a C++ ``terminate`` and SIGABRT, naming neither the group's ranks nor the one
that did not arrive.

How it works:

- While a watchdog is armed (:func:`megamoe.process_group.init_distributed` arms one for a CUDA job),
  :mod:`megamoe.comms` hands it every collective it ran: the operation, its global ranks, when it was
  issued, and a completion probe: a CUDA event recorded on the current stream right after the call (or
  after the ``wait()`` of an asynchronous one). The stream waits for the collective there, so the event
  completes only once the collective has.
- A daemon thread looks every ``poll_s`` at the oldest collectives: completed ones are dropped (one
  stream completes its work in order, so the oldest pending one is the one that is stuck). Once the
  oldest has been pending for ``timeout_s`` (``--comm-timeout``), the thread diagnoses it as a gloo
  timeout is diagnosed (:meth:`CollectiveTimeout.diagnose`: the store says which ranks did not arrive;
  the healthy ranks' watchdogs report the same collective) and hands the CollectiveTimeout to
  ``on_timeout``. :mod:`megamoe.cli.launch` prints it as the one ``error:`` line and ends the process with
  exit code 1: the main thread is blocked in CUDA, and only the process's exit ends it.
- NCCL's watchdog must come later, so the process group's own timeout is ``--comm-timeout`` plus
  :data:`DIAGNOSIS_RESERVE_S` (see :func:`megamoe.process_group.init_distributed`). It stays the fallback,
  should a probe's query itself hang (torch notes that ``cudaEventQuery`` can, while another thread holds
  the CUDA context).

The ``TORCH_NCCL_*`` environment is left as the user sets it (nothing is set here):
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` keeps torch's default (take the process down on an NCCL error or
timeout: the fallback); with ``TORCH_NCCL_BLOCKING_WAIT=1`` ``wait()`` blocks the host and raises NCCL's
timeout error in the calling thread, which :mod:`megamoe.comms` turns into a CollectiveTimeout like gloo's
(this watchdog, earlier, usually reports first); the flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``
with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``) still dumps when NCCL's own watchdog fires;
``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` concerns only a hung NCCL watchdog thread.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from typing import Callable, NamedTuple

import torch

from megamoe.collective_timeout import _GRACE_MAX_S, _STORE_SLACK_S, CollectiveTimeout

__all__ = ["DIAGNOSIS_RESERVE_S", "CollectiveWatchdog", "cuda_stream_probe", "arm", "disarm", "armed",
           "on_stuck_collective", "stuck_collective_handler"]

logger = logging.getLogger(__name__)

# What the process group's own timeout (NCCL's watchdog) adds to ours: the diagnosis's wait for the
# group's other ranks and its store calls (at most 30 + 10 s), the quiet ranks' wait before they print
# (10 s, megamoe.cli.launch), and 10 s of margin for a loaded host.
DIAGNOSIS_RESERVE_S = _GRACE_MAX_S + _STORE_SLACK_S + 20.0


class _Pending(NamedTuple):
    operation: str
    group_ranks: tuple[int, ...]
    done: Callable[[], bool]
    issued_at: float        # time.monotonic()


def cuda_stream_probe() -> Callable[[], bool]:
    """Whether the current CUDA stream has got past this point: an event recorded now, queried later."""
    event = torch.cuda.Event()
    event.record()
    return event.query


class CollectiveWatchdog:
    """Watches the collectives handed to :meth:`watch`; once the oldest pending one is ``timeout_s``
    seconds old, diagnoses it and calls ``on_timeout`` with the CollectiveTimeout (once, on the watchdog's
    thread). ``probe``: makes a collective's completion probe (default: :func:`cuda_stream_probe`)."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[CollectiveTimeout], None], *,
                 probe: Callable[[], Callable[[], bool]] | None = None, poll_s: float = 1.0):
        for name, value in (("timeout_s", timeout_s), ("poll_s", poll_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"CollectiveWatchdog.{name} must be a number of seconds > 0, got {value!r}")
        self.timeout_s, self.on_timeout, self.poll_s = float(timeout_s), on_timeout, float(poll_s)
        self.probe = probe or cuda_stream_probe
        # Appended by the main thread, popped by the watchdog's: deque's append and popleft are thread-safe.
        self._pending: collections.deque[_Pending] = collections.deque()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, operation: str, group_ranks: tuple[int, ...], *, issued_at: float | None = None) -> None:
        """A collective over ``group_ranks`` (global ranks) was just run (or waited for), issued at
        ``issued_at`` (``time.monotonic()``; default: now)."""
        self._pending.append(_Pending(operation, tuple(group_ranks), self.probe(),
                                      time.monotonic() if issued_at is None else issued_at))

    def overdue(self, now: float | None = None) -> _Pending | None:
        """Drops the completed collectives at the front; returns the oldest pending one if it has been
        pending for the timeout at ``now`` (default: now)."""
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        oldest = self._pending[0] if self._pending else None
        now = time.monotonic() if now is None else now
        return oldest if oldest is not None and now - oldest.issued_at >= self.timeout_s else None

    def check(self, now: float | None = None) -> bool:
        """One look (see :meth:`overdue`); on a stuck collective, diagnoses it, calls ``on_timeout`` and
        returns True."""
        stuck = self.overdue(now)
        if stuck is None:
            return False
        self.on_timeout(CollectiveTimeout.diagnose(stuck.operation, stuck.group_ranks, timeout_s=self.timeout_s))
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="megamoe-collective-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            try:
                if self.check():
                    return
            except Exception:   # noqa: BLE001 - NCCL's own watchdog stays the fallback; say why ours stopped
                logger.exception("the collective watchdog stopped; NCCL's own watchdog remains")
                return


_armed: CollectiveWatchdog | None = None


def arm(watchdog: CollectiveWatchdog) -> None:
    """Start ``watchdog`` and hand it the collectives :mod:`megamoe.comms` runs from now on (replacing
    any armed one)."""
    global _armed
    disarm()
    watchdog.start()
    _armed = watchdog


def disarm() -> None:
    """Stop handing collectives to the armed watchdog, and stop it."""
    global _armed
    if _armed is not None:
        _armed.stop()
    _armed = None


def armed() -> CollectiveWatchdog | None:
    """The armed watchdog (None: none, as on CPU jobs, whose gloo collectives time out themselves)."""
    return _armed


def _log_and_exit(error: CollectiveTimeout) -> None:
    """The handler of a library user who registered none: the diagnosis as one logged error, then exit
    code 1 at once (the main thread is blocked in a CUDA wait that no exception reaches)."""
    try:
        logger.error("%s; if a rank is only slow, raise the collective timeout", error)
    finally:
        os._exit(1)


_stuck_collective_handler: Callable[[CollectiveTimeout], None] = _log_and_exit


def on_stuck_collective(handler: Callable[[CollectiveTimeout], None]) -> None:
    """Register what a watchdog armed from now on does with a stuck collective's diagnosis (the command line
    registers its one ``error:`` line)."""
    global _stuck_collective_handler
    _stuck_collective_handler = handler


def stuck_collective_handler() -> Callable[[CollectiveTimeout], None]:
    """The registered handler (see :func:`on_stuck_collective`)."""
    return _stuck_collective_handler
