"""A timeline of communication and chosen compute, to prove overlap (tests, benchmarks).

Inside :func:`comm_timeline`, every asynchronous collective of :mod:`megamoe.comms.async_collectives`
records an ``"issue"`` event when it is started, ``"wait_start"`` when its caller starts waiting and
``"wait"`` when the wait returned, and the
library's marked compute regions (:func:`timed`: the shared experts' GEMMs, ...) record ``"start"`` and
``"end"``. Outside a timeline nothing is recorded (one list test per call).

Times are seconds of the timeline's clock (:mod:`megamoe.comms.stream_clock`): ``time.perf_counter()`` on
the CPU, where a wait blocks the host; on a CUDA device, timing events on its current stream, since there a
``wait()`` returns at once and only the stream waits (the host clock would read about 0 for every wait).
On CUDA, reading :attr:`Timeline.events` waits for the recorded events.

An event is ``(name, phase, time, tag)``: ``name`` the collective kind (``"all_reduce"``,
``"reduce_scatter"``, ``"all_to_all"``) or the compute region's name; ``tag`` an optional label the
caller gives (e.g. ``"grad_bucket"``, ``"moe_dispatch"``) so tests can pick the events they reason about.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, NamedTuple

import torch

from megamoe.comms.stream_clock import HOST_CLOCK, clock_for

__all__ = ["TimelineEvent", "Timeline", "comm_timeline", "timed", "record_event"]


class TimelineEvent(NamedTuple):
    name: str
    phase: str       # "issue" / "wait_start" / "wait" (collectives), "start" / "end" (compute)
    time: float
    tag: str | None


class Timeline:
    """Recorded events (``events``, in recording order) and the clock that times new ones."""

    def __init__(self, events: Iterable[TimelineEvent] = (), *, clock=HOST_CLOCK):
        self.clock = clock
        self._events = list(events)
        self._stamped: list[tuple[str, str, object, str | None]] = []     # not yet turned into seconds

    @property
    def events(self) -> list[TimelineEvent]:
        if self._stamped:
            times = self.clock.seconds([stamp for _, _, stamp, _ in self._stamped])
            self._events += [TimelineEvent(n, p, t, tag) for (n, p, _, tag), t in zip(self._stamped, times)]
            self._stamped = []
        return self._events

    def select(self, name: str | None = None, phase: str | None = None, tag: str | None = None) -> list[float]:
        """Times of the events matching every given filter, in recording order."""
        return [e.time for e in self.events if (name is None or e.name == name)
                and (phase is None or e.phase == phase) and (tag is None or e.tag == tag)]

    def blocked_seconds(self, tag: str | None = None) -> float:
        """Seconds callers spent blocked in ``wait()`` (``"wait_start"`` to ``"wait"``; on CUDA the seconds
        the stream was blocked), for collectives tagged ``tag`` (all without). Communication time that
        compute did NOT hide: a blocking run's figure is (about) its whole communication time, so
        ``1 - overlapped / blocking`` is the fraction of it that overlap hid."""
        total, started = 0.0, {}
        for e in self.events:
            if tag is not None and e.tag != tag:
                continue
            if e.phase == "wait_start":
                started.setdefault(e.name, []).append(e.time)
            elif e.phase == "wait" and started.get(e.name):
                total += e.time - started[e.name].pop(0)
        return total


_active_timelines: list[Timeline] = []


@contextlib.contextmanager
def comm_timeline(device: torch.device | str | None = None) -> Iterator[Timeline]:
    """Record the timeline of the block (nested timelines all record), timed on ``device``'s clock (the
    model's device: CUDA events on its current stream; default: the CPU's)."""
    timeline = Timeline(clock=clock_for(device))
    _active_timelines.append(timeline)
    try:
        yield timeline
    finally:
        del _active_timelines[next(i for i, t in enumerate(_active_timelines) if t is timeline)]


def record_event(name: str, phase: str, tag: str | None = None) -> None:
    """Append one event to every active timeline (nothing when none is active)."""
    if _active_timelines:
        stamps = {}     # one stamp per kind of clock: nested timelines see the same time
        for t in _active_timelines:
            if t.clock.key not in stamps:
                stamps[t.clock.key] = t.clock.stamp()
            t._stamped.append((name, phase, stamps[t.clock.key], tag))


@contextlib.contextmanager
def timed(name: str, tag: str | None = None) -> Iterator[None]:
    """Mark a compute region: ``"start"`` and ``"end"`` events around the block."""
    record_event(name, "start", tag)
    try:
        yield
    finally:
        record_event(name, "end", tag)
