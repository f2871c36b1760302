"""Host (CPU) memory that device tensors pass through on their way to or from disk.

A checkpoint of the distributed optimizer (:mod:`megamoe.training.distributed_optimizer`) moves its state
between the device and the files bucket by bucket, through host buffers, so that the device never holds a
full-shape fp32 copy of the state. Every such buffer is made by :func:`host_buffer`: one place that says
which memory is host staging. On an accelerator that is simply memory of another device; on a CPU-only
run, where "host" and "device" are the same memory, :func:`observe_host_buffers` is how a measurement
(:class:`megamoe.training.memory_measure.DeviceMemory`) tells the two apart.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["host_buffer", "observe_host_buffers"]

_observers: list[Callable[[torch.Tensor], None]] = []


def host_buffer(shape, dtype: torch.dtype, *, staging_for: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised host (CPU) tensor to stage data of the device ``staging_for`` in (see the module
    docstring). For the ``meta`` device a meta tensor: a dry run has no values to stage, only sizes. Not
    pinned: the copies through it are synchronous, and pinning many buffers of one checkpoint costs more
    than it saves."""
    device = "meta" if torch.device(staging_for).type == "meta" else "cpu"
    with _disable_current_modes():      # made outside any dispatch mode measuring the device (DeviceMemory)
        t = torch.empty(shape, dtype=dtype, device=device)
    for observe in _observers:
        observe(t)
    return t


@contextlib.contextmanager
def observe_host_buffers(callback: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``callback(t)`` with every buffer :func:`host_buffer` makes while the context is active."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)
