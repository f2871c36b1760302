"""The comm counter (calls and bytes per collective kind and group) and the recording every
collective of :mod:`megamoe.comms` does; the naming of timed-out collectives."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megamoe import collective_watchdog
from megamoe.collective_timeout import CollectiveTimeout, is_timeout
from megamoe.comms.groups import group_ranks


@dataclass
class CommCounter:
    """Calls and bytes per (collective kind, group ranks), as seen by this rank.

    ``bytes`` counts the payload this rank hands to the collective (its input), which is what the
    tests reason about: an all-reduce of an [T, H] fp32 tensor counts ``T*H*4`` bytes.
    """

    _calls: dict = field(default_factory=lambda: defaultdict(int))
    _bytes: dict = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, group: ProcessGroup | None, nbytes: int) -> None:
        key = (kind, group_ranks(group))
        self._calls[key] += 1
        self._bytes[key] += int(nbytes)

    def _select(self, table: dict, kind: str | None, group: ProcessGroup | Sequence[int] | None) -> int:
        ranks = None
        if group is not None:
            ranks = tuple(group) if isinstance(group, (tuple, list)) else group_ranks(group)
        return sum(v for (k, r), v in table.items()
                   if (kind is None or k == kind) and (ranks is None or r == ranks))

    def calls(self, kind: str | None = None, group=None) -> int:
        """Number of calls, optionally filtered by kind and by group (a ProcessGroup or its ranks)."""
        return self._select(self._calls, kind, group)

    def bytes(self, kind: str | None = None, group=None) -> int:
        """Bytes sent, optionally filtered like :meth:`calls`."""
        return self._select(self._bytes, kind, group)

    def kinds(self) -> dict[str, int]:
        """Calls per kind, for quick assertions and benchmark tables."""
        out: dict[str, int] = defaultdict(int)
        for (k, _), v in self._calls.items():
            out[k] += v
        return dict(out)

    def reset(self) -> None:
        self._calls.clear()
        self._bytes.clear()


_active_counters: list[CommCounter] = []


@contextlib.contextmanager
def comm_counter() -> Iterator[CommCounter]:
    """Count every collective issued inside the block (nested counters all count)."""
    counter = CommCounter()
    _active_counters.append(counter)
    try:
        yield counter
    finally:
        # By identity: list.remove compares with ==, and two counters that saw the same calls are equal.
        del _active_counters[next(i for i, c in enumerate(_active_counters) if c is counter)]


def _record(kind: str, group: ProcessGroup | None, tensor: torch.Tensor) -> None:
    if _active_counters:
        nbytes = tensor.numel() * tensor.element_size()
        for c in _active_counters:
            c.record(kind, group, nbytes)


@contextlib.contextmanager
def _timeout_named(kind: str, group: ProcessGroup | None, peers: Sequence[int] | None = None, *,
                   watched: bool = True, issued_at: float | None = None) -> Iterator[None]:
    """Re-raise a timeout of the torch.distributed call inside as a :class:`CollectiveTimeout`
    naming ``kind`` and the ranks involved: ``group``'s, or for point-to-point operations this
    rank and its ``peers`` (global ranks). Other errors pass unchanged.

    While a :mod:`~megamoe.collective_watchdog` is armed (CUDA jobs: NCCL returns before the data has
    moved), a call that returns hands the collective to it (``watched``: False for the start of an
    asynchronous one, handed over at its wait with the start's ``issued_at``, ``time.monotonic()``)."""
    try:
        yield
    except RuntimeError as e:
        if not is_timeout(e):
            raise
        raise CollectiveTimeout.diagnose(kind, _ranks(group, peers), e) from e
    watchdog = collective_watchdog.armed()
    if watched and watchdog is not None:
        watchdog.watch(kind, _ranks(group, peers), issued_at=issued_at)


def _ranks(group: ProcessGroup | None, peers: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(sorted({dist.get_rank(), *peers})) if peers is not None else group_ranks(group)
