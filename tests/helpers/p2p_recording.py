"""Records the point-to-point posts the real pipeline code makes, for the NCCL ordering model
(:mod:`megamoe.pipeline.nccl_ordering`).

:func:`recording_p2p` stands in for ``torch.distributed`` inside :mod:`megamoe.comms.point_to_point`
(the one module that issues point-to-point operations): every ``send`` / ``recv`` / ``isend`` /
``irecv`` and ``batch_isend_irecv`` becomes a :class:`P2PPost` of the calling rank, every wait on its
handle (or a blocking call) is noted, and nothing moves: receive buffers keep what they held. Run each
rank's code in turn over torch's fake process group (:func:`fake_rank`), one process, no model needed."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from megamoe.comms import group_ranks
from megamoe.comms import point_to_point
from megamoe.pipeline.nccl_ordering import P2PPost, P2PTransfer
from parallel_state import destroy_model_parallel, initialize_model_parallel


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int, **layout):
    """This process plays global rank ``rank`` of ``world_size`` over torch's fake process group (every
    collective a no-op, receive buffers left as allocated; CPU and meta tensors); yields the ParallelState of
    ``layout``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # not imported by spawned ranks
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield initialize_model_parallel(**layout)
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()


class _Work:
    """The handle of a recorded post: waiting on it is recorded, it never reports completion by itself."""

    def __init__(self, recorder: "_RecordingDist", post: int):
        self.recorder, self.post = recorder, post

    def wait(self, timeout=None) -> bool:
        self.recorder.waited.add(self.post)
        return True

    def is_completed(self) -> bool:
        return False


class _RecordingOp:
    """``dist.P2POp`` of the recorder: what to post, unchecked."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


class _RecordingDist:
    """The subset of ``torch.distributed`` point_to_point uses; everything else is torch's."""

    P2POp = _RecordingOp

    def __init__(self):
        self.posts: list[P2PPost] = []
        self.waited: set[int] = set()

    def __getattr__(self, name):
        return getattr(dist, name)

    def _post(self, transfers, batched: bool, group) -> int:
        self.posts.append(P2PPost(tuple(transfers), batched, group_ranks(group) if batched else (),
                                  frozenset(self.waited)))
        return len(self.posts) - 1

    @staticmethod
    def _transfer(kind: str, tensor: torch.Tensor, peer: int, tag: int) -> P2PTransfer:
        return P2PTransfer(kind, peer, tensor.numel() * tensor.element_size(), tag)

    def isend(self, tensor, dst, group=None, tag=0):
        return _Work(self, self._post([self._transfer("send", tensor, dst, tag)], False, group))

    def irecv(self, tensor, src, group=None, tag=0):
        return _Work(self, self._post([self._transfer("recv", tensor, src, tag)], False, group))

    def send(self, tensor, dst, group=None, tag=0):
        self.isend(tensor, dst, group, tag).wait()

    def recv(self, tensor, src, group=None, tag=0):
        self.irecv(tensor, src, group, tag).wait()
        return src

    def batch_isend_irecv(self, ops):
        kinds = {self.isend: "send", self.irecv: "recv"}
        transfers = [self._transfer(kinds[op.op], op.tensor, op.peer, op.tag) for op in ops]
        post = self._post(transfers, True, ops[0].group)
        return [_Work(self, post) for _ in ops]


@contextlib.contextmanager
def recording_p2p() -> Iterator[list[P2PPost]]:
    """Record this rank's point-to-point posts made through :mod:`megamoe.comms` inside the block;
    yields the list they are appended to."""
    recorder = _RecordingDist()
    saved = point_to_point.dist
    point_to_point.dist = recorder
    try:
        yield recorder.posts
    finally:
        point_to_point.dist = saved
