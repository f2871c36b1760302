"""Point-to-point operations of pipeline parallelism: blocking send / recv, the batched
:func:`batch_send_recv` (every send and receive of a rank posted at once), and the asynchronous
:func:`isend` whose handles :func:`wait_sends` completes (the interleaved schedule's sends).

Inside :func:`~megamoe.comms.comm_timeline` each of them records ``wait_start`` / ``wait`` events tagged
:data:`PIPELINE_TAG` around the time it blocks, so ``blocked_seconds("pipeline")`` is a stage's time waiting
on its neighbours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megamoe.comms.counter import _record, _timeout_named
from megamoe.comms.groups import group_size
from megamoe.comms.timeline import record_event

# The timeline tag of every pipeline point-to-point wait: the time a stage spends blocked on its
# neighbours (the bubble, measured, plus the transfers themselves).
PIPELINE_TAG = "pipeline"


def send(tensor: torch.Tensor, dst_global_rank: int, group: ProcessGroup | None = None, *, tag: int = 0) -> None:
    """Point-to-point send (pipeline activations / gradients); ``tag`` matches it with the receive of
    the same tag (messages of one tag between two ranks match in order)."""
    _record("send", group, tensor)
    record_event("send", "wait_start", PIPELINE_TAG)
    with _timeout_named("send", group, peers=(dst_global_rank,)):
        dist.send(tensor.contiguous(), dst=dst_global_rank, group=group, tag=tag)
    record_event("send", "wait", PIPELINE_TAG)


def recv(tensor: torch.Tensor, src_global_rank: int, group: ProcessGroup | None = None, *,
         tag: int = 0) -> torch.Tensor:
    """Point-to-point receive into ``tensor`` of the message sent with ``tag``; returns it."""
    _record("recv", group, tensor)
    record_event("recv", "wait_start", PIPELINE_TAG)
    with _timeout_named("recv", group, peers=(src_global_rank,)):
        dist.recv(tensor, src=src_global_rank, group=group, tag=tag)
    record_event("recv", "wait", PIPELINE_TAG)
    return tensor


@dataclass
class PendingSend:
    """An :func:`isend` in flight: its handle, the tensor it reads (kept alive until the send completes)
    and its peer (for a timeout's diagnosis)."""
    work: object
    tensor: torch.Tensor
    dst_global_rank: int
    group: ProcessGroup | None


def isend(tensor: torch.Tensor, dst_global_rank: int, group: ProcessGroup | None = None, *,
          tag: int = 0) -> PendingSend:
    """Asynchronous point-to-point send, counted as one "send" (its bytes) keyed by ``group``: posts
    the send and returns at once, so a rank never waits for its consumer. Complete it with
    :func:`wait_sends` (until then the tensor must not change; the handle keeps it alive). ``tag``
    pairs it with the :func:`recv` of the same tag, whatever order the receiver posts its receives in."""
    _record("send", group, tensor)
    tensor = tensor.detach().contiguous()
    with _timeout_named("isend", group, peers=(dst_global_rank,)):
        work = dist.isend(tensor, dst=dst_global_rank, group=group, tag=tag)
    return PendingSend(work, tensor, dst_global_rank, group)


def wait_sends(pending: Sequence[PendingSend]) -> None:
    """Wait for every :func:`isend` in ``pending`` to complete (no traffic of its own, not counted)."""
    for send_ in pending:
        record_event("isend", "wait_start", PIPELINE_TAG)
        with _timeout_named("isend", send_.group, peers=(send_.dst_global_rank,)):
            send_.work.wait()
        record_event("isend", "wait", PIPELINE_TAG)


def batch_send_recv(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: ProcessGroup | None,
) -> list[torch.Tensor]:
    """Post every send ``(tensor, dst_global_rank)`` and receive ``(buffer, src_global_rank)`` of this
    rank at once, then wait for all of them; returns the receive buffers (filled in place), in order.

    Why batched: two neighbouring pipeline stages often exchange in both directions at the same
    moment (activation one way, gradient the other). With blocking ``send`` then ``recv`` on both
    sides, each waits for the other's receive (gloo) and they deadlock; posting everything before
    waiting cannot. Messages between the same pair of ranks in the same direction are matched in
    the order they are posted, on both sides.

    Peers are GLOBAL ranks that belong to ``group``. Each send counts as one "send" (its bytes) and
    each receive as one "recv" (the buffer's bytes), both keyed by ``group``. ``group=None`` is one
    rank: only empty lists are accepted (there is nobody to talk to).
    """
    if not sends and not recvs:
        return []
    if group_size(group) == 1:
        raise ValueError(
            "batch_send_recv: group has one rank (None), so there is no peer; pass the pipeline's "
            "process group, or no sends/recvs"
        )
    ops = []
    for tensor, dst in sends:
        _record("send", group, tensor)
        ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), peer=dst, group=group))
    for buffer, src in recvs:
        if not buffer.is_contiguous():
            raise ValueError("batch_send_recv: receive buffers must be contiguous (received in place)")
        _record("recv", group, buffer)
        ops.append(dist.P2POp(dist.irecv, buffer, peer=src, group=group))
    peers = [dst for _, dst in sends] + [src for _, src in recvs]
    record_event("batch_send_recv", "wait_start", PIPELINE_TAG)
    with _timeout_named("batch_send_recv", group, peers=peers):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    record_event("batch_send_recv", "wait", PIPELINE_TAG)
    return [buffer for buffer, _ in recvs]
