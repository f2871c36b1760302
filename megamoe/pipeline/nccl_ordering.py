"""A checked model of NCCL's point-to-point ordering: does a recorded exchange complete or deadlock?

The pipeline schedules only ever met gloo, which buffers every send and matches messages by tag. NCCL
does neither, so an order of sends and receives that is fine on gloo can hang on GPUs. This module
replays each rank's recorded point-to-point posts (:class:`P2PPost`, e.g. recorded from the real
schedule code over torch's fake process group) under NCCL's rules and reports completion, or the
cycle of waits that a deadlock is.

The rules (ProcessGroupNCCL on top of NCCL)
-------------------------------------------
- Streams. A single ``isend`` / ``irecv`` / ``send`` / ``recv`` goes to the two-rank communicator of
  its rank pair, one stream for both directions; a ``batch_isend_irecv`` group goes to the process
  group's communicator and its one stream. On each stream, posts run strictly in posting order: a post
  starts only when every earlier post of its rank on the same stream completed.
- Waits. Waiting on a post (``Work.wait()``, or the blocking ``send`` / ``recv``) orders everything
  the rank posts afterwards behind it (on NCCL the compute stream waits, and later posts wait for
  the compute stream), so a later post starts only when every post waited before it completed.
- Groups. A batched group starts as a whole; its operations then complete in any order, and the group
  completes when all of them have.
- Matching. Per communicator and direction, the ``n``-th send from rank ``a`` to rank ``b`` pairs with
  ``b``'s ``n``-th receive from ``a``. Tags are ignored: the model checks that paired operations
  carry the same tag and the same number of bytes, since NCCL would hand a wrong message over silently.
- Buffering. A started send completes when its matching receive has started (rendezvous), or
  eagerly when it fits in what is left of the connection's buffer of ``buffer_bytes`` (NCCL's p2p
  buffer, a few MiB; 0: every send is a rendezvous, as every send larger than the buffer is). A
  receive completes once its matching send has started and delivered.

A deadlock is a state where nothing can progress and some post has not completed; every stuck rank
then waits for a peer to start an operation that is queued behind something the rank itself has not
finished, so following "waits for" from any stuck rank closes a cycle, which the report names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

__all__ = ["NcclOrderingResult", "P2PPost", "P2PTransfer", "check_nccl_ordering"]


@dataclass(frozen=True)
class P2PTransfer:
    """One send or receive of a post: ``kind`` "send" or "recv", the peer's global rank, the bytes
    and the tag the code gave it (NCCL ignores tags; the model checks paired ones agree)."""
    kind: str
    peer: int
    nbytes: int
    tag: int = 0

    def __post_init__(self):
        if self.kind not in ("send", "recv"):
            raise ValueError(f"P2PTransfer.kind must be 'send' or 'recv', got {self.kind!r}")
        if self.nbytes < 0:
            raise ValueError(f"P2PTransfer.nbytes must be >= 0, got {self.nbytes}")


@dataclass(frozen=True)
class P2PPost:
    """What a rank posts at once: one transfer (``batched=False``: ``isend``/``irecv``/``send``/
    ``recv``) or a ``batch_isend_irecv`` group over the process group of global ``group_ranks``.
    ``waited_before``: indices (in this rank's list of posts) of the posts the rank waited for before
    posting this one."""
    transfers: tuple[P2PTransfer, ...]
    batched: bool
    group_ranks: tuple[int, ...] = ()
    waited_before: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self):
        if not self.transfers:
            raise ValueError("P2PPost.transfers is empty: record a post only when it moves something")
        if not self.batched and len(self.transfers) != 1:
            raise ValueError(f"P2PPost: an unbatched post has one transfer, got {len(self.transfers)}")
        if self.batched and not self.group_ranks:
            raise ValueError("P2PPost.group_ranks is empty: a batched post needs its process group's ranks")


@dataclass(frozen=True)
class NcclOrderingResult:
    """``completed``: every post completed. Otherwise ``problem`` says why in one paragraph: the cycle
    of waits (``cycle``: the ranks in it, in order), a receive nobody sends, or a pairing of
    operations whose tags or sizes disagree."""
    completed: bool
    problem: str = ""
    cycle: tuple[int, ...] = ()


def _communicator(rank: int, post: P2PPost, transfer: P2PTransfer) -> tuple:
    if post.batched:
        return ("group",) + tuple(post.group_ranks)
    return ("pair", min(rank, transfer.peer), max(rank, transfer.peer))


def _describe(rank: int, transfer: P2PTransfer, index: int, post_index: int) -> str:
    direction = "to" if transfer.kind == "send" else "from"
    return (f"rank {rank}'s {transfer.kind} #{index} {direction} rank {transfer.peer} ({transfer.nbytes} bytes, tag "
            f"{transfer.tag}, in its post {post_index})")


def check_nccl_ordering(posts: Mapping[int, Sequence[P2PPost]], buffer_bytes: int = 0) -> NcclOrderingResult:
    """Replay ``posts[rank]`` (every rank's posts, in posting order) under NCCL's rules (module
    docstring) with ``buffer_bytes`` of buffer per connection and direction; report completion, a
    deadlock (with its cycle of waits) or a mispairing."""
    if buffer_bytes < 0:
        raise ValueError(f"buffer_bytes must be >= 0, got {buffer_bytes}")
    # Every operation: (rank, post index, position in post). Its stream, and its pairing key.
    stream_of: dict[tuple[int, int], tuple] = {}
    key_of: dict[tuple[int, int, int], tuple] = {}       # op -> (communicator, src, dst, n)
    ops_by_key: dict[tuple, tuple[int, int, int]] = {}   # ("send"|"recv", communicator, src, dst, n) -> op
    counts: dict[tuple, int] = {}
    for rank, rank_posts in posts.items():
        for p, post in enumerate(rank_posts):
            if any(w >= p for w in post.waited_before):
                raise ValueError(f"rank {rank}'s post {p} waits for a post that comes after it")
            # A post's stream is its communicator's: the pair's for a single op, the group's for a batch.
            stream_of[rank, p] = _communicator(rank, post, post.transfers[0])
            for i, transfer in enumerate(post.transfers):
                comm = _communicator(rank, post, transfer)
                src, dst = (rank, transfer.peer) if transfer.kind == "send" else (transfer.peer, rank)
                n = counts.get((transfer.kind, comm, src, dst), 0)
                counts[transfer.kind, comm, src, dst] = n + 1
                key_of[rank, p, i] = (comm, src, dst, n)
                ops_by_key[transfer.kind, comm, src, dst, n] = (rank, p, i)

    def transfer(op):
        rank, p, i = op
        return posts[rank][p].transfers[i]

    def matching(op):
        other = "recv" if transfer(op).kind == "send" else "send"
        return ops_by_key.get((other,) + key_of[op])

    for op in key_of:      # pairing checks first: a mispairing is a bug whatever the timing
        partner = matching(op)
        if partner is None or transfer(op).kind == "recv":
            continue
        send, recv = transfer(op), transfer(partner)
        if (send.tag, send.nbytes) != (recv.tag, recv.nbytes):
            n = key_of[op][3]
            return NcclOrderingResult(False, f"mispaired: {_describe(op[0], send, n, op[1])} pairs with "
                                             f"{_describe(partner[0], recv, n, partner[1])}; NCCL matches by order, "
                                             "not by tag, so the receiver would get the wrong message")

    started: set[tuple[int, int]] = set()
    done: set[tuple[int, int, int]] = set()
    buffered: dict[tuple, int] = {}        # (communicator, src, dst) -> bytes sent but not yet received

    def post_complete(rank, p):
        return all((rank, p, i) in done for i in range(len(posts[rank][p].transfers)))

    def can_start(rank, p):
        post = posts[rank][p]
        return all(post_complete(rank, w) for w in post.waited_before) and all(
            post_complete(rank, q) for q in range(p) if stream_of[rank, q] == stream_of[rank, p])

    progressed = True
    while progressed:
        progressed = False
        for rank, rank_posts in posts.items():
            for p in range(len(rank_posts)):
                if (rank, p) not in started and can_start(rank, p):
                    started.add((rank, p))
                    progressed = True
        for op in key_of:
            if op in done or op[:2] not in started:
                continue
            partner = matching(op)
            this = transfer(op)
            connection = key_of[op][:3]
            if this.kind == "send":
                if partner is not None and partner[:2] in started:
                    done.update((op, partner))
                elif buffered.get(connection, 0) + this.nbytes <= buffer_bytes:
                    buffered[connection] = buffered.get(connection, 0) + this.nbytes
                    done.add(op)
                else:
                    continue
            else:
                if partner is None or partner not in done:
                    continue      # the send side moves it (rendezvous) or has not delivered yet
                buffered[connection] -= this.nbytes
                done.add(op)
            progressed = True

    stuck = {rank: next((p for p in range(len(rank_posts)) if not post_complete(rank, p)), None)
             for rank, rank_posts in posts.items()}
    stuck = {rank: p for rank, p in stuck.items() if p is not None}
    if not stuck:
        return NcclOrderingResult(True)
    return _deadlock(posts, stuck, done, key_of, matching, transfer)


def _deadlock(posts, stuck, done, key_of, matching, transfer) -> NcclOrderingResult:
    """Follow "waits for" from a stuck rank's earliest unfinished post until a rank repeats."""
    def blocker(rank):
        p = stuck[rank]
        i = next(i for i in range(len(posts[rank][p].transfers)) if (rank, p, i) not in done)
        return (rank, p, i)

    lines, seen, rank = [], [], min(stuck)
    while rank not in seen:
        seen.append(rank)
        op = blocker(rank)
        this, n = transfer(op), key_of[op][3]
        partner = matching(op)
        if partner is None:
            other = "recv" if this.kind == "send" else "send"
            return NcclOrderingResult(False, f"deadlock: {_describe(rank, this, n, op[1])} waits for a {other} rank "
                                             f"{this.peer} never posts")
        lines.append(f"{_describe(rank, this, n, op[1])} waits for rank {partner[0]} to start its post "
                     f"{partner[1]}")
        rank = partner[0]
    cycle = tuple(seen[seen.index(rank):])
    return NcclOrderingResult(False, "deadlock (cycle of waits " + " -> ".join(map(str, cycle + cycle[:1])) + "): "
                              + "; ".join(lines[seen.index(rank):]), cycle)
