"""MTP speculation inside the serving engine (megamoe.serving.speculation): with speculative_tokens=1 every
request's greedy tokens equal generate()'s, drafts are proposed and counted per request and in the metrics;
with drafts forced right or wrong (an oracle replaces the MTP layer's), accepted drafts give two tokens per
step and rejected ones roll back, the tokens still generate()'s; a sampled request is never drafted; what the
engine cannot draft is refused. A tiny DeepSeek-V3 (MLA) with one MTP layer (its own random weights)."""

import functools
import random

import pytest
import torch

from megamoe.inference.generation import GenerationConfig, generate
from megamoe.serving import Engine, EngineConfig, SamplingParams
from megamoe.serving.speculation import MTPSpeculator
from tests.helpers.hf_models import V
from tests.helpers.inference import SOLO, _mtp_model, _our_model

pytestmark = pytest.mark.usefixtures("one_thread")

_rng = random.Random(3)
PROMPTS = [[_rng.randrange(1, V) for _ in range(n)] for n in (3, 9, 6, 5)]
MAX_TOKENS = [9, 7, 8, 6]


mtp_model = functools.cache(_mtp_model)


@functools.cache
def expected():
    return [generate(mtp_model(), SOLO, [p], GenerationConfig(max_new_tokens=n)).token_ids[0]
            for p, n in zip(PROMPTS, MAX_TOKENS)]


def serve(params=None, order=(2, 0, 3, 1)):
    """Requests arriving in ``order``, one per step; (final outputs by id, new tokens per output by id, engine
    metrics)."""
    engine = Engine(mtp_model(), SOLO, EngineConfig(block_size=4, kv_cache_memory=1 << 20, max_num_batched_tokens=16,
                                                    speculative_tokens=1))
    pending, done, sizes = list(order), {}, {}
    while pending or engine.has_unfinished():
        if pending:
            request_id = pending.pop(0)
            engine.add_request(request_id, PROMPTS[request_id],
                               params or SamplingParams(max_tokens=MAX_TOKENS[request_id]))
        for output in engine.step():
            sizes.setdefault(output.request_id, []).append(len(output.new_token_ids))
            if output.finished:
                done[output.request_id] = output
    return done, sizes, engine.metrics()


def test_mtp_drafts_keep_greedy_tokens_and_are_counted():
    done, _, metrics = serve()
    assert {i: done[i].token_ids for i in done} == dict(enumerate(expected()))
    assert metrics.spec_proposed == sum(o.spec_proposed for o in done.values()) > 0
    assert metrics.spec_accepted == sum(o.spec_accepted for o in done.values())


def test_accepted_drafts_give_two_tokens_and_rejected_ones_roll_back(monkeypatch):
    """An oracle drafts the right next token for even request ids and a wrong one for odd ids."""
    real_draft = MTPSpeculator.draft

    def oracle(self, committed, hidden):
        real_draft(self, committed, hidden)              # the MTP layer runs (its cache filled), then is overruled
        for request in self.drafts:
            right = expected()[request.request_id][len(request.output)]
            self.drafts[request] = right if request.request_id % 2 == 0 else (right + 1) % V
    monkeypatch.setattr(MTPSpeculator, "draft", oracle)
    done, sizes, metrics = serve()
    assert {i: done[i].token_ids for i in done} == dict(enumerate(expected()))
    for request_id, output in done.items():
        accepted = request_id % 2 == 0
        assert output.spec_proposed > 0, request_id
        assert output.spec_accepted == (output.spec_proposed if accepted else 0), request_id
        assert (2 in sizes[request_id]) == accepted and max(sizes[request_id]) <= 2, (request_id, sizes[request_id])
    assert metrics.spec_accepted == sum(done[i].spec_proposed for i in (0, 2))


def test_drafts_are_the_mtp_layers_teacher_forced_predictions(monkeypatch):
    """Every draft equals the MTP layer's greedy token run over the whole final sequence by the training path
    (model.mtp_hidden_states): the draft for token x[n + 1] reads the main model's hidden state at n - 1 and the
    embedding of x[n], at rotary position n - 1, whatever the batch. A misaligned position, rotary, hidden state or
    fed token in the engine would draft other tokens (the benchmark's 0.00 acceptance came from random weights)."""
    drafts = {}                                          # (request id, index in its output) -> the draft
    real_draft = MTPSpeculator.draft

    def record(self, committed, hidden):
        real_draft(self, committed, hidden)
        for request, token in self.drafts.items():
            drafts[request.request_id, len(request.output)] = token
    monkeypatch.setattr(MTPSpeculator, "draft", record)
    done, _, _ = serve()
    assert {i: done[i].token_ids for i in done} == dict(enumerate(expected()))
    model = mtp_model()
    with torch.no_grad():
        for request_id, prompt in enumerate(PROMPTS):
            ids = torch.tensor([prompt + expected()[request_id]])
            hidden, _ = model.run_layers(ids)
            states, _ = model.mtp_hidden_states(hidden, ids)
            teacher = model.logits(states[0], norm=False)[0].argmax(-1).tolist()    # at i: the draft for x[i + 2]
            mine = {index: token for (rid, index), token in drafts.items() if rid == request_id}
            assert mine, request_id
            assert mine == {index: teacher[len(prompt) + index - 2] for index in mine}, request_id


def test_sampled_requests_are_not_drafted():
    done, _, metrics = serve(SamplingParams(temperature=0.8, seed=1, max_tokens=5), order=(0, 1))
    assert metrics.spec_proposed == 0 and all(o.spec_proposed == 0 for o in done.values())


def test_what_cannot_be_drafted_is_refused():
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        Engine(_our_model("qwen3_moe"), SOLO, EngineConfig(kv_cache_memory=1 << 20, speculative_tokens=1))
    with pytest.raises(ValueError, match="pass 1"):
        Engine(mtp_model(), SOLO, EngineConfig(kv_cache_memory=1 << 20, speculative_tokens=2))
