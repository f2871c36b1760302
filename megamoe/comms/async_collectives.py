"""Asynchronous collectives (``async_op=True``): started now, waited for later, so that compute runs while
the data moves. The overlap of gradient reduction with the backward (:mod:`megamoe.training.grad_buckets`)
and of the MoE dispatch all-to-all with the shared experts (:mod:`megamoe.moe.token_dispatcher`).

Each start is counted by the comm counter exactly like its blocking twin (same kind, group and bytes), so
an overlapped run moves, by the counter, the same volume as a blocking one; and it records ``"issue"``,
``"wait_start"`` (the caller starts waiting) and ``"wait"`` (done) events in an active
:func:`~megamoe.comms.timeline.comm_timeline`.

Ordering: collectives of one process group run in the order they are started, on every rank alike, so
callers start them in an order every rank of the group agrees on (e.g. bucket order, not readiness order).

- :func:`all_reduce_async`, :func:`reduce_scatter_flat_async`: no autograd; return a :class:`CommHandle`
  whose ``wait()`` returns the result.
- :func:`all_to_all_start` / :func:`all_to_all_wait`: the autograd pair of the uneven all-to-all. Forward:
  the start issues the exchange into a fresh buffer, the wait blocks until it is filled and returns it.
  Backward mirrors it: the WAIT's backward starts the reverse exchange (splits swapped) of the incoming
  gradient, and the START's backward waits for it and returns it as the input's gradient, so the backward
  of whatever ran between start and wait in the forward runs while the gradient is in flight.

Groups of one rank: completed handles, nothing counted or recorded (the identity, as everywhere in
:mod:`megamoe.comms`). On torch's ``fake`` process group (the meta-device tests) the works complete at once.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megamoe.comms.collectives import _reduce_scatter_single
from megamoe.comms.counter import _record, _timeout_named
from megamoe.comms.groups import group_size
from megamoe.comms.timeline import record_event

__all__ = ["CommHandle", "all_reduce_async", "reduce_scatter_flat_async", "PendingAllToAll", "all_to_all_start",
           "all_to_all_wait"]


class CommHandle:
    """A started collective. :meth:`wait` blocks until it is done (once; later calls return at once) and
    returns its result (the reduced tensor, the shard, ...)."""

    def __init__(self, work, result: torch.Tensor, kind: str, group: ProcessGroup | None, tag: str | None,
                 then: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self._work, self._result, self.kind, self.group, self.tag, self._then = work, result, kind, group, tag, then
        self.done = work is None
        self.issued_at = time.monotonic()      # the collective watchdog's clock starts at the issue

    @property
    def buffer(self) -> torch.Tensor:
        """The result tensor, filled in the background until :meth:`wait` returns (read it only after)."""
        return self._result

    @classmethod
    def completed(cls, result: torch.Tensor) -> "CommHandle":
        return cls(None, result, "", None, None)

    def wait(self) -> torch.Tensor:
        if not self.done:
            record_event(self.kind, "wait_start", self.tag)
            with _timeout_named(self.kind, self.group, issued_at=self.issued_at):
                self._work.wait()
            self.done, self._work = True, None
            record_event(self.kind, "wait", self.tag)
            if self._then is not None:
                self._result = self._then(self._result)
        return self._result


def all_reduce_async(tensor: torch.Tensor, group: ProcessGroup | None, *, tag: str | None = None) -> CommHandle:
    """Start an in-place sum of ``tensor`` over ``group``; ``wait()`` returns ``tensor``, reduced. Counted as
    ``"all_reduce"`` (the tensor's bytes). Do not touch ``tensor`` before the wait."""
    if group_size(group) == 1:
        return CommHandle.completed(tensor)
    _record("all_reduce", group, tensor)
    record_event("all_reduce", "issue", tag)
    with _timeout_named("all_reduce", group, watched=False):     # watched from its wait on
        work = dist.all_reduce(tensor, group=group, async_op=True)
    return CommHandle(work, tensor, "all_reduce", group, tag)


def reduce_scatter_flat_async(buffer: torch.Tensor, group: ProcessGroup | None, *,
                              tag: str | None = None) -> CommHandle:
    """Start :func:`~megamoe.comms.reduce_scatter_flat` (1-D ``buffer`` [N * k] summed over the N ranks, rank
    r keeping elements [r k, (r + 1) k)); ``wait()`` returns the new [k] shard (one rank: the buffer itself).
    Counted as ``"reduce_scatter"`` with the whole buffer's bytes, as the blocking one."""
    if buffer.dim() != 1:
        raise ValueError(f"reduce_scatter_flat_async: the buffer must be 1-D, got shape {tuple(buffer.shape)}")
    world = group_size(group)
    if world == 1:
        return CommHandle.completed(buffer)
    if buffer.numel() % world:
        raise ValueError(f"reduce-scatter: first dim {buffer.numel()} is not divisible by the group size {world}")
    _record("reduce_scatter", group, buffer)
    record_event("reduce_scatter", "issue", tag)
    src = buffer.contiguous()
    out = torch.empty(src.numel() // world, dtype=src.dtype, device=src.device)
    with _timeout_named("reduce_scatter", group, watched=False):     # watched from its wait on
        work = _reduce_scatter_single(out, src, group=group, async_op=True)
    # Keep the source alive until the wait: the collective reads it in the background.
    return CommHandle(work, out, "reduce_scatter", group, tag, then=lambda shard, _src=src: shard)


def _start_all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
                      tag: str | None) -> CommHandle:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    _record("all_to_all", group, x)
    record_event("all_to_all", "issue", tag)
    with _timeout_named("all_to_all", group, watched=False):     # watched from its wait on
        work = dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits,
                                      group=group, async_op=True)
    return CommHandle(work, out, "all_to_all", group, tag, then=lambda o, _x=x: o)


class PendingAllToAll:
    """An all-to-all in flight (:func:`all_to_all_start`), until :func:`all_to_all_wait`. Holds the forward's
    handle and, during the backward, the reverse exchange's."""

    def __init__(self, output_splits: list[int], input_splits: list[int], group, tag: str | None):
        self.output_splits, self.input_splits, self.group, self.tag = output_splits, input_splits, group, tag
        self.forward: CommHandle | None = None
        self.backward: CommHandle | None = None
        self.output: torch.Tensor | None = None     # the start's output (autograd-connected), for the wait


class _AllToAllStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending: PendingAllToAll):
        ctx.pending = pending
        pending.forward = _start_all_to_all(x, pending.output_splits, pending.input_splits, pending.group,
                                            pending.tag)
        return pending.forward.buffer      # filled in the background: read only after the wait

    @staticmethod
    def backward(ctx, grad):
        # The reverse exchange of ``grad`` was started by the wait's backward; finish it.
        pending = ctx.pending
        result = pending.backward.wait()
        pending.backward = None
        return result, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, pending: PendingAllToAll):
        ctx.pending = pending
        pending.forward.wait()
        pending.forward = None
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        # The transpose of an all-to-all is the all-to-all with the splits swapped; started here, waited for
        # in the start's backward.
        pending.backward = _start_all_to_all(grad, pending.input_splits, pending.output_splits, pending.group,
                                             pending.tag)
        # The buffer's gradient is ``grad`` itself, passed on to the start's backward only as the edge that
        # makes it run: that one returns the reverse exchange's result instead.
        return grad, None


def all_to_all_start(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                     group: ProcessGroup | None, *, tag: str | None = None) -> PendingAllToAll:
    """Start the uneven all-to-all of :func:`~megamoe.comms.all_to_all` (rows ``input_splits[r]`` to rank r,
    ``output_splits[r]`` received from rank r, stacked in rank order); finish it with :func:`all_to_all_wait`.
    Forward: issues it; backward: waits for the reverse exchange the wait's backward started. Counted as
    ``"all_to_all"`` (``x``'s bytes), as the blocking one, forward and backward."""
    pending = PendingAllToAll([int(s) for s in output_splits], [int(s) for s in input_splits], group, tag)
    if group_size(group) == 1:
        pending.output = x
        return pending
    pending.output = _AllToAllStart.apply(x, pending)
    return pending


def all_to_all_wait(pending: PendingAllToAll) -> torch.Tensor:
    """The received rows [sum(output_splits), ...] of a started all-to-all. Forward: waits for it; backward:
    starts the reverse exchange of the gradient (waited for in the start's backward)."""
    if group_size(pending.group) == 1:
        return pending.output
    out = _AllToAllWait.apply(pending.output, pending)
    pending.output = None
    return out
