"""A timeline of communication and chosen compute, to prove overlap (tests, benchmarks).

Inside :func:`comm_timeline`, every asynchronous collective of :mod:`megamoe.comms.async_collectives`
records an ``"issue"`` event when it is started, ``"wait_start"`` when its caller starts waiting and
``"wait"`` when the wait returned, and the
library's marked compute regions (:func:`timed`: the shared experts' GEMMs, ...) record ``"start"`` and
``"end"``. Times are ``time.perf_counter()`` seconds of this process. Outside a timeline nothing is
recorded (one list test per call).

An event is ``(name, phase, time, tag)``: ``name`` the collective kind (``"all_reduce"``,
``"reduce_scatter"``, ``"all_to_all"``) or the compute region's name; ``tag`` an optional label the
caller gives (e.g. ``"grad_bucket"``, ``"moe_dispatch"``) so tests can pick the events they reason about.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

__all__ = ["TimelineEvent", "Timeline", "comm_timeline", "timed", "record_event"]


class TimelineEvent(NamedTuple):
    name: str
    phase: str       # "issue" / "wait_start" / "wait" (collectives), "start" / "end" (compute)
    time: float
    tag: str | None


@dataclass
class Timeline:
    events: list[TimelineEvent] = field(default_factory=list)

    def select(self, name: str | None = None, phase: str | None = None, tag: str | None = None) -> list[float]:
        """Times of the events matching every given filter, in recording order."""
        return [e.time for e in self.events if (name is None or e.name == name)
                and (phase is None or e.phase == phase) and (tag is None or e.tag == tag)]

    def blocked_seconds(self, tag: str | None = None) -> float:
        """Seconds callers spent blocked in ``wait()`` (``"wait_start"`` to ``"wait"``), for collectives
        tagged ``tag`` (all without). Communication time that compute did NOT hide: a blocking run's
        figure is (about) its whole communication time, so ``1 - overlapped / blocking`` is the fraction
        of it that overlap hid."""
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
def comm_timeline() -> Iterator[Timeline]:
    """Record the timeline of the block (nested timelines all record)."""
    timeline = Timeline()
    _active_timelines.append(timeline)
    try:
        yield timeline
    finally:
        del _active_timelines[next(i for i, t in enumerate(_active_timelines) if t is timeline)]


def record_event(name: str, phase: str, tag: str | None = None) -> None:
    """Append one event to every active timeline (nothing when none is active)."""
    if _active_timelines:
        event = TimelineEvent(name, phase, time.perf_counter(), tag)
        for t in _active_timelines:
            t.events.append(event)


@contextlib.contextmanager
def timed(name: str, tag: str | None = None) -> Iterator[None]:
    """Mark a compute region: ``"start"`` and ``"end"`` events around the block."""
    record_event(name, "start", tag)
    try:
        yield
    finally:
        record_event(name, "end", tag)
