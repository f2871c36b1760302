"""NCCL's point-to-point ordering as a checked model (issue 29, row 1 and "proving it without a GPU").

The model's rules on hand-made posts (one stream per rank pair for single operations, rendezvous
sends beyond the buffer, groups that complete in any order, waits that order later posts, tags
ignored but checked); then the posts of the REAL schedule code, recorded over torch's fake process
group one rank at a time (tests/helpers/p2p_recording.py): the unbatched interleaved order of commit 803d33f
deadlocks at pp 2 V 2, pp 3 V 2 and pp 4 V 2 m 8, and today's 1F1B, interleaved, forward-only and
generation code completes over a grid of (pp, V, m) even when every send waits for its receive."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megamoe.inference.generation import _step
from megamoe.inference.pipeline_forward import pipeline_logits
from megamoe.inference.sampling import SamplingConfig
from megamoe.pipeline import forward_backward, forward_only
from megamoe.pipeline.nccl_ordering import P2PPost, P2PTransfer, check_nccl_ordering
from tests.helpers.p2p_recording import fake_rank, recording_p2p
from tests.helpers.interleaved_pipeline import _recording_steps

FIXTURE = Path(__file__).parents[1] / "fixtures" / "unbatched_interleaved_p2p_posts.json"
SHAPE = (2, 3)
NBYTES = 2 * 3 * 4


def single(kind, peer, waited=(), tag=0, nbytes=NBYTES):
    return P2PPost((P2PTransfer(kind, peer, nbytes, tag),), False, (), frozenset(waited))


def batch(*transfers, ranks=(0, 1), waited=()):
    return P2PPost(tuple(P2PTransfer(kind, peer, NBYTES, tag) for kind, peer, tag in transfers), True, ranks,
                   frozenset(waited))


# ---------------------------------------------------------------------------------------------------------
# The rules, on hand-made posts
# ---------------------------------------------------------------------------------------------------------
def test_two_ranks_that_both_send_first_deadlock_once_sends_outgrow_the_buffer():
    posts = {0: [single("send", 1), single("recv", 1)], 1: [single("send", 0), single("recv", 0)]}
    result = check_nccl_ordering(posts, buffer_bytes=0)
    assert not result.completed and result.cycle == (0, 1), result
    assert "deadlock (cycle of waits 0 -> 1 -> 0): rank 0's send #0 to rank 1 (24 bytes, tag 0, in its post 0) " \
           "waits for rank 1 to start its post 1" in result.problem, result.problem
    # With room for the message in the connection's buffer the sends complete eagerly (gloo-like).
    assert check_nccl_ordering(posts, buffer_bytes=NBYTES).completed
    # Sends queue behind each other in the buffer: two messages need room for two.
    twice = {r: [single("send", 1 - r), single("send", 1 - r), single("recv", 1 - r), single("recv", 1 - r)]
             for r in (0, 1)}
    assert not check_nccl_ordering(twice, buffer_bytes=NBYTES).completed
    assert check_nccl_ordering(twice, buffer_bytes=2 * NBYTES).completed


def test_a_batched_group_is_posted_together_and_completes_in_any_order():
    posts = {0: [batch(("send", 1, 0), ("recv", 1, 0))], 1: [batch(("send", 0, 0), ("recv", 0, 0))]}
    assert check_nccl_ordering(posts, buffer_bytes=0).completed
    # Groups run one after another on the group's stream: the receive of a LATER group cannot save a send.
    posts = {0: [batch(("send", 1, 0)), batch(("recv", 1, 0))], 1: [batch(("send", 0, 0)), batch(("recv", 0, 0))]}
    assert check_nccl_ordering(posts, buffer_bytes=0).cycle == (0, 1)


def test_single_operations_of_different_rank_pairs_run_on_different_streams_unless_waited():
    # A ring of three ranks, each sending to the next and then receiving from the previous one: the pair
    # streams are independent, so it completes; waiting for the send before posting the receive closes
    # the cycle 0 -> 1 -> 2 -> 0.
    def ring(waited):
        return {r: [single("send", (r + 1) % 3), single("recv", (r - 1) % 3, waited=(0,) if waited else ())]
                for r in range(3)}
    assert check_nccl_ordering(ring(False), buffer_bytes=0).completed
    result = check_nccl_ordering(ring(True), buffer_bytes=0)
    assert not result.completed and sorted(result.cycle) == [0, 1, 2], result


def test_tags_are_ignored_but_pairs_must_carry_the_same_message():
    # Two messages 0 -> 1 received in the other order: gloo matches them by tag, NCCL by order.
    posts = {0: [batch(("send", 1, 7), ("send", 1, 8))], 1: [batch(("recv", 0, 8), ("recv", 0, 7))]}
    result = check_nccl_ordering(posts, buffer_bytes=1 << 20)
    assert not result.completed and result.problem.startswith("mispaired: rank 0's send #0 to rank 1 (24 bytes, "
                                                              "tag 7"), result.problem
    sizes = {0: [single("send", 1, nbytes=8)], 1: [single("recv", 0, nbytes=4)]}
    assert "mispaired" in check_nccl_ordering(sizes).problem


def test_an_operation_nobody_matches_never_completes():
    result = check_nccl_ordering({0: [single("recv", 1)], 1: []})
    assert not result.completed and result.problem == (
        "deadlock: rank 0's recv #0 from rank 1 (24 bytes, tag 0, in its post 0) waits for a send rank 1 never posts")
    # Single operations and groups use different communicators: they never match each other.
    assert not check_nccl_ordering({0: [single("send", 1)], 1: [batch(("recv", 0, 0))]}, buffer_bytes=1 << 20).completed


@pytest.mark.parametrize("make, message", [
    (lambda: check_nccl_ordering({}, buffer_bytes=-1), "buffer_bytes must be >= 0, got -1"),
    (lambda: P2PTransfer("put", 1, 4), "P2PTransfer.kind must be 'send' or 'recv', got 'put'"),
    (lambda: P2PTransfer("send", 1, -4), "P2PTransfer.nbytes must be >= 0, got -4"),
    (lambda: P2PPost((), True, (0, 1)), "P2PPost.transfers is empty"),
    (lambda: P2PPost((P2PTransfer("send", 1, 4),) * 2, False), "an unbatched post has one transfer, got 2"),
    (lambda: P2PPost((P2PTransfer("send", 1, 4),), True), "P2PPost.group_ranks is empty"),
    (lambda: check_nccl_ordering({0: [single("send", 1, waited=(0,))]}), "rank 0's post 0 waits for a post that "
                                                                          "comes after it"),
])
def test_bad_posts_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ---------------------------------------------------------------------------------------------------------
# The interleaved order of commit 803d33f (unbatched isend after each op, blocking recv before it)
# ---------------------------------------------------------------------------------------------------------
def _unbatched_posts(lines: list[str]) -> dict[int, list[P2PPost]]:
    """The fixture's posts (its "about" says how they were recorded and what the tokens mean)."""
    posts = {}
    for rank, line in enumerate(lines):
        posts[rank], waited = [], set()
        for index, token in enumerate(line.split()):
            peer, tag = token[1:].rstrip("w").split("/")
            posts[rank].append(single("send" if token[0] == "S" else "recv", int(peer), waited, int(tag)))
            if token.endswith("w"):
                waited.add(index)
    return posts


@pytest.mark.parametrize("case", ["training pp 2 V 2 m 4", "training pp 3 V 2 m 6", "training pp 4 V 2 m 8",
                                  "forward-only pp 2 V 2 m 4"])
def test_the_unbatched_interleaved_order_deadlocks_under_nccl(case):
    posts = _unbatched_posts(json.loads(FIXTURE.read_text())["cases"][case])
    result = check_nccl_ordering(posts, buffer_bytes=0)
    assert not result.completed and result.problem.startswith("deadlock (cycle of waits"), (case, result)
    # It only ever ran on gloo, which buffers sends: with room for every message it completes.
    total = sum(t.nbytes for rank_posts in posts.values() for post in rank_posts for t in post.transfers)
    assert check_nccl_ordering(posts, buffer_bytes=total).completed, case


# ---------------------------------------------------------------------------------------------------------
# Today's schedules, recorded from the real code, over a grid
# ---------------------------------------------------------------------------------------------------------
def _record(pp: int, run) -> dict[int, list[P2PPost]]:
    """Every pipeline rank's posts while ``run(rank, state)`` runs, one rank at a time."""
    posts = {}
    for rank in range(pp):
        with fake_rank(rank, pp, pp=pp) as state, recording_p2p() as posts[rank]:
            run(rank, state)
    return posts


def _assert_completes(posts, what):
    assert any(posts.values()), f"{what}: nothing recorded"
    result = check_nccl_ordering(posts, buffer_bytes=0)
    assert result.completed, f"{what}: {result.problem}"


def _assert_batched_on_the_pipeline_group(posts, what):
    """Every post is a batch over a whole pipeline group: on NCCL an unbatched send / recv runs on a two-rank
    communicator of its own per rank pair (communicator sprawl, issue 29 row 14)."""
    for rank, rank_posts in posts.items():
        for post in rank_posts:
            assert post.batched and rank in post.group_ranks and len(post.group_ranks) == len(posts), \
                f"{what}: rank {rank} posted {post}"


# 1F1B (V = 1) takes any number of micro-batches, the interleaved schedule multiples of pp.
SCHEDULE_GRID = [(pp, v, m) for pp in (2, 3, 4) for v in (1, 2, 3)
                 for m in ((1, pp, 2 * pp + 1) if v == 1 else (pp, 2 * pp, 3 * pp))]


@pytest.mark.parametrize("pp, v, m", SCHEDULE_GRID)
def test_todays_schedules_complete_under_nccl_ordering(pp, v, m):
    def steps(rank):
        chunks = _recording_steps(rank, pp, v, [], SHAPE)
        return chunks[0] if v == 1 else chunks      # one step: 1F1B; one per chunk: interleaved

    for what, schedule in ((f"training pp {pp} V {v} m {m}", forward_backward),
                           (f"forward-only pp {pp} V {v} m {m}", forward_only)):
        posts = _record(pp, lambda rank, state: schedule(steps(rank), m, state, SHAPE, torch.float32))
        _assert_completes(posts, what)
        _assert_batched_on_the_pipeline_group(posts, what)


class _StubStages:
    """Stands in for a pipelined GPTMoEModel in generation and pipeline_logits: their point-to-point
    traffic depends only on the chunk layout, so the stages compute zeros."""

    def __init__(self, rank: int, pp: int, virtual_stages: int):
        self.rank, self.pp, self.virtual_pipeline_stages = rank, pp, virtual_stages
        self.config = SimpleNamespace(hidden_size=4, vocab_size=5)

    def parameters(self):
        yield torch.zeros(1)

    def chunk_is_first(self, chunk):
        return chunk == 0 and self.rank == 0

    def chunk_is_last(self, chunk):
        return chunk == self.virtual_pipeline_stages - 1 and self.rank == self.pp - 1

    def run_layers(self, inputs, positions, caches, attention_mask, chunk=0):
        return torch.zeros(*inputs.shape[:2], self.config.hidden_size), None

    def logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.config.vocab_size)

    def __call__(self, inputs, position_ids=None, *, document_ids=None, chunk=0):
        width = self.config.vocab_size if self.chunk_is_last(chunk) else self.config.hidden_size
        return torch.zeros(*inputs.shape[:2], width), None


@pytest.mark.parametrize("pp, v", [(2, 1), (2, 2), (3, 2), (4, 3)])
def test_generation_and_pipeline_logits_complete_under_nccl_ordering(pp, v):
    def generate_tokens(rank, state):
        model, inputs = _StubStages(rank, pp, v), torch.zeros(2, 3, dtype=torch.long)
        for _ in range(3):      # a prefill and two decode steps
            _step(model, state, inputs, None, {}, torch.ones(2, 3, dtype=torch.bool), SamplingConfig(), [])

    for what, run in ((f"generation pp {pp} V {v}", generate_tokens),
                      (f"pipeline_logits pp {pp} V {v}",
                       lambda rank, state: pipeline_logits(_StubStages(rank, pp, v), state,
                                                           torch.zeros(2, 3, dtype=torch.long)))):
        posts = _record(pp, run)
        _assert_completes(posts, what)
        _assert_batched_on_the_pipeline_group(posts, what)
