"""The per-step message rank 0 broadcasts to the ranks that follow it (megamoe.serving.step_broadcast):
every change round-trips exactly (floats by their bits), a foreign format is refused, a follower whose last
schedule differs from rank 0's stops with an error. The
broadcast itself, under TP / EP / PP, is tests/multirank/test_serving_layouts.py."""

import pytest
import torch

from megamoe.serving import SamplingParams
from megamoe.serving.request import Request
from megamoe.serving.step_broadcast import (ABORT, STOPPED, AddRequest, StepBroadcast, StepMessage, decode, encode,
                                            schedule_digest)


def test_message_round_trips_every_change_in_order():
    params = SamplingParams(temperature=0.1 + 0.2, top_k=7, top_p=0.95, seed=12, max_tokens=9, stop_token_ids=(3, 4),
                            logprobs=True)
    message = StepMessage([AddRequest(5, (1, 2, 3), params), (ABORT, 5), AddRequest(6, (9,), SamplingParams()),
                           (STOPPED, 2)], previous_digest=schedule_digest([]), shutdown=False)
    back = decode(encode(message))
    assert back == message
    assert back.changes[0].params.temperature == 0.1 + 0.2          # the exact double, not a rounded one
    assert decode(encode(StepMessage(shutdown=True))).shutdown


def test_a_foreign_message_is_refused():
    with pytest.raises(RuntimeError, match="format"):
        decode([1, 0, 0, 0])
    with pytest.raises(RuntimeError, match="unknown change kind 9"):
        decode(encode(StepMessage([(9, 1)])))


def test_a_follower_with_another_schedule_stops(monkeypatch):
    from megamoe import comms
    request = Request(3, [1, 2], SamplingParams(), torch.Generator(), 0)
    sent = encode(StepMessage(previous_digest=schedule_digest([(request, 2)])))

    def fake_broadcast(tensor, src, group):        # what rank 0 would send: its length, then the message
        values = torch.tensor([len(sent)]) if tensor.numel() == 1 and len(sent) != 1 else torch.tensor(sent)
        return tensor.copy_(values)
    monkeypatch.setattr(comms, "broadcast_", fake_broadcast)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    follower = StepBroadcast.__new__(StepBroadcast)
    follower.group, follower.is_source, follower.device, follower.changes = None, False, "cpu", []
    follower.last_digest = schedule_digest([(request, 2)])
    assert follower.receive().changes == []                   # the same schedule: accepted
    follower.last_digest = schedule_digest([(request, 1)])
    with pytest.raises(RuntimeError, match="diverged"):
        follower.receive()
