"""What a timeline's times mean on each device: when the work queued so far on the device reached a point.

On the CPU (gloo) a collective's ``wait()`` blocks the host until the data has arrived, so the host clock
(``time.perf_counter()``) measures it. On CUDA (NCCL) ``wait()`` returns at once: it only makes the current
stream wait for the NCCL stream, and the kernels queued after it start once the collective is done. The
host clock then reads about 0 for every wait and the compute regions read their launch time, not their
run time. :class:`CudaEventClock` stamps the current stream with a ``torch.cuda.Event(enable_timing=True)``
instead: the time between a stamp taken before ``wait()`` and one taken after it is the time the stream
(the compute queued behind the wait) was blocked on the collective, and a marked compute region's stamps
bracket its kernels' run time.

A clock's ``stamp()`` is cheap and does not synchronise (an event is only recorded); ``seconds(stamps)``
turns stamps into seconds, after waiting for the events (read a timeline once the timed work is queued).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

__all__ = ["HostClock", "CudaEventClock", "HOST_CLOCK", "clock_for"]


class HostClock:
    """``time.perf_counter()`` seconds of this process (CPU, meta: devices whose work runs when it is called)."""

    key = "host"

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, stamps: Sequence[float]) -> list[float]:
        return list(stamps)


HOST_CLOCK = HostClock()


class CudaEventClock:
    """Timing events recorded on the current stream of ``device``. Seconds are the host time at which the
    clock was created plus the device time from an origin event recorded then (only differences matter)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.key = ("cuda", device.index)
        self._origin = self.stamp()
        self._origin_host = time.perf_counter()

    def stamp(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, stamps: Sequence) -> list[float]:
        self._origin.synchronize()
        out = []
        for event in stamps:
            event.synchronize()     # the host waits for the stream to reach the stamp
            out.append(self._origin_host + self._origin.elapsed_time(event) / 1000.0)
        return out


def clock_for(device: torch.device | str | None) -> HostClock | CudaEventClock:
    """CUDA events for a CUDA device (its current stream), the host clock otherwise (None: the CPU)."""
    device = torch.device(device if device is not None else "cpu")
    if device.type != "cuda":
        return HOST_CLOCK
    return CudaEventClock(torch.device("cuda", device.index if device.index is not None else
                                       torch.cuda.current_device()))
