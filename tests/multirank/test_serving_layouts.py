"""The serving engine under parallel layouts (2 spawned ranks, one spawn): rank 0 adds requests in a random
arrival order between its steps (and aborts one), the other rank follows (``Engine.follow``, rank 0's changes
broadcast before each step); every request's greedy tokens equal single-process ``generate()`` of that
prompt alone, under TP 2, EP 2 with replica slots (all-to-all) and PP 2, for a GQA and an MLA family.

Under EP 2 the router is skewed to two experts of one EP rank, and the engine also runs with online EPLB
every few steps: the placement changes, the balancedness improves, the tokens do not. Under PP 2 the engine
also speculates with the MTP layer (on the last stage), its drafts overruled by an oracle (the MTP layer
still runs): right for even request ids, wrong for odd ones, so that both acceptance and rollback cross the
stages; the tokens are those without speculation, and the drafts are counted per request.

Data-parallel attention (dp 2 x ep 2, 12 slots for 8 experts, all-to-all and input-sharded all-gather): each rank
serves the requests rank 0 assigns it (least loaded), one rank idles for several steps (an empty forward) while
the other decodes a long request; greedy tokens equal ``generate()``'s, seeded samples equal ``generate()`` with
the same seed and request id, whichever rank served them; rank 0 ends a request of rank 1 on a stop string (only
rank 0 has a tokenizer); aborting a request that lives on rank 1 frees its blocks there; an idle step costs the
step broadcast and one all-reduce."""

import random
import zlib

import pytest
import torch

from megamoe.inference.generation import GenerationConfig, generate
from megamoe.spawned_ranks import run_on_ranks
from tests.helpers.hf_models import V
from tests.helpers.inference import SOLO, _mtp_model, _our_model

SKEWED, MTP = "deepseek_v3, router skewed", "deepseek_v3 with an MTP layer"
EP2 = (dict(ep=2), dict(dispatcher="alltoall", num_expert_slots=12))
# name -> (layout, MoE fields, model, EngineConfig fields): GQA and MLA families both covered, one model build
# per layout.
LAYOUTS = {
    "tp2": (dict(tp=2), {}, "qwen3_moe", {}),
    "ep2 alltoall, 12 slots for 8 experts": (*EP2, SKEWED, {}),
    "ep2 alltoall, 12 slots for 8 experts, EPLB every 3 steps": (*EP2, SKEWED, dict(eplb_interval=3)),
    "pp2": (dict(pp=2), {}, "deepseek_v3", {}),
    "pp2, MTP speculation, oracle drafts": (dict(pp=2), {}, MTP, dict(speculative_tokens=1)),
}
# The selection bias of the skewed router: experts 4 and 5 (both on EP rank 0 under the default placement of
# 12 slots: experts 0-5 | 6, 7, 0-3) take most tokens; deepseek_v3's grouped routing keeps them (one group).
HOT_BIAS = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.3, 0.2, 0.0, 0.0])
_rng = random.Random(5)
# Lengths across block boundaries (block size 4 below), two sharing a prefix of two full blocks.
PREFIX = [_rng.randrange(1, V) for _ in range(8)]
PROMPTS = [[_rng.randrange(1, V) for _ in range(n)] for n in (3, 9, 5, 13)] + [PREFIX + [7, 3], PREFIX + [9]]
MAX_TOKENS = [5, 3, 6, 4, 5, 4]
ABORTED = 3                    # aborted after its first step
# Data-parallel attention: (layout, MoE fields, family); a long request first (to rank 0), then the others.
DP_LAYOUTS = {
    "dp2 ep2 alltoall, 12 slots": (dict(ep=2), dict(dispatcher="alltoall", num_expert_slots=12), "qwen3_moe"),
    "dp2 ep2 allgather sharded, 12 slots": (dict(ep=2), dict(dispatcher="allgather", input_sharded=True,
                                                            num_expert_slots=12), "deepseek_v3"),
}
LONG = len(PROMPTS)            # the long request's id: PROMPTS[0] decoding LONG_TOKENS tokens
LONG_TOKENS = 16
SAMPLING = dict(temperature=0.9, top_k=20, top_p=0.95, seed=3)
SAMPLED = {1, 2, 4}            # request ids sampled with SAMPLING (the others greedy)
STOP_STRING_IDS = (0, 5)       # greedy, ending on a stop string: the text of their 2nd and 3rd greedy tokens



def _serve(engine, order, rng):
    """Rank 0: add requests in ``order``, one to three per step at random, abort ABORTED after its first
    output; returns {request id: final output} of the requests that finished."""
    from megamoe.serving import SamplingParams
    pending, done = list(order), {}
    while pending or engine.has_unfinished():
        for _ in range(min(len(pending), rng.randint(0, 2) if engine.has_unfinished() else 1)):
            request_id = pending.pop(0)
            engine.add_request(request_id, PROMPTS[request_id], SamplingParams(max_tokens=MAX_TOKENS[request_id]))
        for output in engine.step():
            if output.request_id == ABORTED and not output.finished:
                engine.abort(ABORTED)
            if output.finished and output.finish_reason != "abort":
                done[output.request_id] = output
    engine.shutdown()
    return done


class _Letters:
    """A tokenizer for stop strings (rank 0's only, as under ``megamoe serve``): one letter per token."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def _params(request_id, stops):
    """``stops``: {request id: stop string}."""
    from megamoe.serving import SamplingParams
    if request_id == LONG:
        return SamplingParams(max_tokens=LONG_TOKENS)
    return SamplingParams(max_tokens=MAX_TOKENS[request_id], stop=stops.get(request_id, ()),
                          **(SAMPLING if request_id in SAMPLED else {}))


def _prompt(request_id):
    return PROMPTS[0] if request_id == LONG else PROMPTS[request_id]


def _serve_dp(engine, order, rng, stops):
    """Rank 0 under data-parallel attention: adds LONG first, then ``order`` (none to two per step at random), and
    aborts the first request served by rank 1 after its first output. Returns the finished requests' tokens, the
    rank serving each request, each step's tokens per rank, the aborted id, the collectives of an idle step and
    the metrics at the end."""
    from megamoe import comms
    pending, done, served, steps, aborted = [LONG, *order], {}, {}, [], None
    while pending or engine.has_unfinished():
        for _ in range(min(len(pending), rng.randint(0, 2) if engine.has_unfinished() else 1)):
            request_id = pending.pop(0)
            engine.add_request(request_id, _prompt(request_id), _params(request_id, stops))
            served[request_id] = engine.requests[request_id].dp_rank
        for output in engine.step():
            if aborted is None and served[output.request_id] == 1 and not output.finished:
                aborted = output.request_id
                engine.abort(aborted)
            if output.finished and output.finish_reason != "abort":
                done[output.request_id] = output.token_ids
        steps.append(tuple(rank.step_tokens for rank in engine.metrics().data_parallel))
    metrics = engine.metrics()
    with comms.comm_counter() as counter:
        engine.step()                                     # nothing to do anywhere
    engine.shutdown()
    return done, served, steps, aborted, counter.kinds(), metrics


def _follow_dp(engine):
    """Rank 1 under data-parallel attention: follows rank 0's steps; returns, for each abort of a request it held,
    (id, its blocks no other request references, KV blocks used before, after)."""
    aborts, abort = [], engine.abort

    def recording_abort(request_id):
        request, pool = engine.requests.get(request_id), engine.scheduler.pool
        if request is None:
            return abort(request_id)
        own = sum(1 for block in set(request.block_table) if block is not None and pool.refs[block] == 1)
        before = pool.num_used
        abort(request_id)
        aborts.append((request_id, own, before, pool.num_used))
    engine.abort = recording_abort
    engine.follow()
    return aborts


def _model(kind, state=SOLO, **moe):
    if kind == MTP:
        return _mtp_model(state)
    if kind != SKEWED:
        return _our_model(kind, state, **moe)
    model = _our_model("deepseek_v3", state, **moe)
    for layer in model.moe_layers().values():
        layer.router.expert_bias.add_(HOT_BIAS)
    return model


def _overrule_drafts(speculator, expected):
    """The last stage's drafts: the MTP layer runs, then the expected token for even request ids, a wrong one
    for odd ids."""
    real = speculator._mtp_drafts

    def oracle(committed, hidden, wanted):
        drafts = real(committed, hidden, wanted)
        for i, request in enumerate(wanted):
            right = expected[request.request_id][len(request.output)]
            drafts[i] = right if request.request_id % 2 == 0 else (right + 1) % V
        return drafts
    speculator._mtp_drafts = oracle


def _worker(rank, world_size, layouts, expected, stops):
    from megamoe.serving import Engine, EngineConfig
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    results = {}
    for name, (sizes, moe, kind, settings) in layouts.items():
        state = initialize_model_parallel(**sizes)
        model = _model(kind, state, **moe)
        engine = Engine(model, state, EngineConfig(block_size=4, kv_cache_memory=1 << 20, max_num_batched_tokens=16,
                                                   **settings))
        if settings.get("speculative_tokens"):
            _overrule_drafts(engine._speculator, expected[kind])
        order = list(range(len(PROMPTS)))
        random.Random(zlib.crc32(name.encode())).shuffle(order)
        if rank == 0:
            done = _serve(engine, order, random.Random(1))
            placements = {i: layer.placement.slot_to_expert.tolist() for i, layer in model.moe_layers().items()}
            reports = engine.rebalancer.reports if engine.rebalancer is not None else []
            results[name] = (order, done, engine.metrics(), placements, reports)
        else:
            engine.follow()
        destroy_model_parallel()
    for name, (sizes, moe, family) in DP_LAYOUTS.items():
        state = initialize_model_parallel(**sizes)
        engine = Engine(_our_model(family, state, **moe), state, EngineConfig(
            block_size=4, kv_cache_memory=1 << 20, max_num_batched_tokens=16, data_parallel_attention=True),
            tokenizer=_Letters() if rank == 0 else None)
        order = list(range(len(PROMPTS)))
        random.Random(zlib.crc32(name.encode())).shuffle(order)
        results[name] = ((order, _serve_dp(engine, order, random.Random(2), stops[family])) if rank == 0
                         else _follow_dp(engine))
        destroy_model_parallel()
    return results


@pytest.mark.slow          # 2 ranks, 7 layouts of tiny models
def test_engine_tokens_equal_generate_under_layouts():
    expected = {}
    for kind in {kind for _, _, kind, _ in LAYOUTS.values()}:
        model = _model(kind)
        expected[kind] = {i: generate(model, SOLO, [p], GenerationConfig(max_new_tokens=MAX_TOKENS[i])).token_ids[0]
                          for i, p in enumerate(PROMPTS)}
    stops = {}                  # the stop strings of STOP_STRING_IDS, per data-parallel family
    for family in {family for _, _, family in DP_LAYOUTS.values()}:
        stops[family] = {i: _Letters().decode(generate(_our_model(family), SOLO, [PROMPTS[i]], GenerationConfig(
            max_new_tokens=MAX_TOKENS[i])).token_ids[0][1:3]) for i in STOP_STRING_IDS}
    results, followed = run_on_ranks(_worker, 2, args=(LAYOUTS, expected, stops))
    for name, (_, _, kind, _) in LAYOUTS.items():
        order, done = results[name][:2]
        what = f"{kind} under {name}, arrival order {order}"
        assert set(done) == set(range(len(PROMPTS))) - {ABORTED}, what
        for request_id, output in done.items():
            assert output.token_ids == expected[kind][request_id], \
                f"{what}: request {request_id} {output.token_ids} != generate()"

    # Online EPLB: the same tokens as without it (checked above), a changed placement, better balance.
    _, plain, plain_metrics, default, _ = results["ep2 alltoall, 12 slots for 8 experts"]
    _, rebalanced, metrics, placements, reports = results["ep2 alltoall, 12 slots for 8 experts, EPLB every 3 steps"]
    assert reports and reports[0].layers, "the skewed load must re-place a layer, else this test cannot fail"
    assert all(placements[i] != default[i] for i in reports[0].layers), (placements, default)
    assert all(r.balancedness_after >= r.balancedness_before for r in reports), reports
    assert reports[0].balancedness_after > reports[0].balancedness_before + 0.1, reports[0]
    before, after = plain_metrics.expert_balancedness, metrics.expert_balancedness     # since the start, /metrics'
    assert set(before) == set(after) and sum(after.values()) > sum(before.values()) + 0.1, (before, after)

    # MTP under PP 2: the tokens of pp2 without speculation (both equal generate() above); the oracle's right
    # drafts (even ids) all accepted, its wrong ones (odd ids) all rolled back, on both stages alike.
    assert expected[MTP] == expected["deepseek_v3"]
    _, speculated, metrics, _, _ = results["pp2, MTP speculation, oracle drafts"]
    for request_id, output in speculated.items():
        accepted = output.spec_proposed if request_id % 2 == 0 else 0
        assert output.spec_proposed > 0 and output.spec_accepted == accepted, (request_id, output)
    assert metrics.spec_accepted > 0 and metrics.spec_proposed > metrics.spec_accepted, metrics
    for name, (_, _, family) in DP_LAYOUTS.items():
        _check_data_parallel_attention(name, family, results[name], followed[name], stops[family])


def _check_data_parallel_attention(name, family, result, follower_aborts, stops):
    model = _our_model(family)
    order, (done, served, steps, aborted, idle_step, metrics) = result
    what = f"{family} under {name}, arrival order {order}"
    for request_id in done:
        params = _params(request_id, stops)
        config = GenerationConfig(max_new_tokens=params.max_tokens, sampling=params.sampling)
        want = generate(model, SOLO, [_prompt(request_id)], config, request_ids=[request_id]).token_ids[0]
        if request_id in stops:       # cut at the token that completes the stop string
            want = want[:next(n for n in range(1, len(want) + 1) if stops[request_id] in _Letters().decode(want[:n]))]
            assert len(want) < params.max_tokens, (what, request_id)      # it did end on the stop string
        assert done[request_id] == want, f"{what}: request {request_id} on rank {served[request_id]}: " \
                                         f"{done[request_id]} != generate()'s {want}"
    assert set(done) == set(served) - {aborted}, what
    assert {served[i] for i in SAMPLED if i != aborted} == {0, 1}, f"{what}: sampled requests on both ranks {served}"
    assert 1 in {served[i] for i in stops if i != aborted}, f"{what}: rank 0 stops a request of rank 1 {served}"
    assert served[LONG] == 0 and len(done[LONG]) == LONG_TOKENS, what
    # One rank idles (an empty forward) while the other computes, for several steps; both compute in others.
    assert sum(1 for mine, other in steps if mine and not other) >= 3, f"{what}: {steps}"
    assert sum(1 for mine, other in steps if mine and other) >= 3, f"{what}: {steps}"
    # The abort of a request served by rank 1 freed its own blocks there at once.
    assert served[aborted] == 1, what
    (request_id, own, before, after), = [a for a in follower_aborts if a[0] == aborted]
    assert own >= 1 and before - after == own, (what, own, before, after)
    assert idle_step == {"broadcast": 2, "all_reduce": 1}, idle_step
    assert (metrics.running, metrics.waiting, metrics.kv_blocks_used) == (0, 0, 0), metrics
    assert len(metrics.data_parallel) == 2 and metrics.kv_blocks_total == 2 * metrics.data_parallel[1].kv_blocks_total
