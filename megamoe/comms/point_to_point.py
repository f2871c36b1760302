"""Point-to-point operations of pipeline parallelism: :func:`batch_send_recv` (every send and receive of a
rank posted at once), what the schedules, generation and the pipeline's logits use. There is no single
send / recv on purpose: on NCCL each would create a two-rank communicator per rank pair, beside the pipeline
group's, and run both directions of the pair on one stream in posting order (see batch_send_recv).

Inside :func:`~megamoe.comms.comm_timeline` it records ``wait_start`` / ``wait`` events tagged
:data:`PIPELINE_TAG` around the time it blocks, so ``blocked_seconds("pipeline")`` is a stage's time waiting
on its neighbours (on CUDA, the time the stream waited: see :mod:`megamoe.comms.stream_clock`)."""

from __future__ import annotations

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


def batch_send_recv(
    sends: Sequence[tuple],
    recvs: Sequence[tuple],
    group: ProcessGroup | None,
) -> list[torch.Tensor]:
    """Post every send ``(tensor, dst_global_rank[, tag])`` and receive ``(buffer, src_global_rank[,
    tag])`` of this rank as ONE ``dist.batch_isend_irecv`` group, then wait for all of them; returns the
    receive buffers (filled in place), in order. No autograd: forward and backward of a pipeline move
    their activations and gradients with separate calls (the schedules pair them).

    Why batched: two neighbouring pipeline stages often exchange in both directions at the same
    moment (activation one way, gradient the other, or both ways around the interleaved ring). Posted
    one by one, NCCL runs the operations between two ranks on one stream, in posting order, and a send
    larger than its buffer (a few MiB) completes only once the receiver reached the matching receive:
    two ranks that both send before they receive wait on each other forever (gloo buffers the sends
    and hides it). A group is posted as a whole and its operations complete in any order, so a
    schedule whose ranks post matching groups cannot deadlock (:mod:`megamoe.pipeline.nccl_ordering`
    checks the schedules' posts). Messages between the same pair of ranks in the same direction are
    matched in the order they are posted, on both sides: NCCL ignores ``tag`` (default 0), gloo
    matches by it, so the orders must agree and the tags only label the messages.

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
    for tensor, dst, *tag in sends:
        _record("send", group, tensor)
        ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), peer=dst, group=group,
                              tag=_tag_or_zero(tag)))
    for buffer, src, *tag in recvs:
        if not buffer.is_contiguous():
            raise ValueError("batch_send_recv: receive buffers must be contiguous (received in place)")
        _record("recv", group, buffer)
        ops.append(dist.P2POp(dist.irecv, buffer, peer=src, group=group, tag=_tag_or_zero(tag)))
    peers = [dst for _, dst, *_ in sends] + [src for _, src, *_ in recvs]
    record_event("batch_send_recv", "wait_start", PIPELINE_TAG)
    with _timeout_named("batch_send_recv", group, peers=peers):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    record_event("batch_send_recv", "wait", PIPELINE_TAG)
    return [buffer for buffer, *_ in recvs]


def _tag_or_zero(optional: list[int]) -> int:
    return optional[0] if optional else 0
