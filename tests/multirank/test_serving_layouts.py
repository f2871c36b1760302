"""The serving engine under parallel layouts (2 spawned ranks, one spawn): rank 0 adds requests in a random
arrival order between its steps (and aborts one), the other rank follows (``Engine.follow``, rank 0's changes
broadcast before each step); every request's greedy tokens equal single-process ``generate()`` of that
prompt alone, under TP 2, EP 2 with replica slots (all-to-all) and PP 2, for a GQA and an MLA family."""

import random
import zlib

import pytest

from megamoe.inference.generation import GenerationConfig, generate
from megamoe.spawned_ranks import run_on_ranks
from tests.helpers.hf_models import V
from tests.helpers.inference import SOLO, _our_model

# name -> (layout, MoE fields, family): GQA and MLA families both covered, one model build per layout.
LAYOUTS = {
    "tp2": (dict(tp=2), {}, "qwen3_moe"),
    "ep2 alltoall, 12 slots for 8 experts": (dict(ep=2), dict(dispatcher="alltoall", num_expert_slots=12),
                                             "deepseek_v3"),
    "pp2": (dict(pp=2), {}, "deepseek_v3"),
}
_rng = random.Random(5)
# Lengths across block boundaries (block size 4 below), two sharing a prefix of two full blocks.
PREFIX = [_rng.randrange(1, V) for _ in range(8)]
PROMPTS = [[_rng.randrange(1, V) for _ in range(n)] for n in (3, 9, 5, 13)] + [PREFIX + [7, 3], PREFIX + [9]]
MAX_TOKENS = [5, 3, 6, 4, 5, 4]
ABORTED = 3                    # aborted after its first step


def _serve(engine, order, rng):
    """Rank 0: add requests in ``order``, one to three per step at random, abort ABORTED after its first
    output; returns {request id: tokens} of the requests that finished."""
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
                done[output.request_id] = output.token_ids
    engine.shutdown()
    return done


def _worker(rank, world_size, layouts):
    from megamoe.serving import Engine, EngineConfig
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    results = {}
    for name, (sizes, moe, family) in layouts.items():
        state = initialize_model_parallel(**sizes)
        model = _our_model(family, state, **moe)
        engine = Engine(model, state, EngineConfig(block_size=4, kv_cache_memory=1 << 20, max_num_batched_tokens=16))
        order = list(range(len(PROMPTS)))
        random.Random(zlib.crc32(name.encode())).shuffle(order)
        if rank == 0:
            results[name] = (order, _serve(engine, order, random.Random(1)))
        else:
            engine.follow()
        destroy_model_parallel()
    return results


@pytest.mark.slow          # 2 ranks, 3 layouts of tiny models
def test_engine_tokens_equal_generate_under_layouts():
    results = run_on_ranks(_worker, 2, args=(LAYOUTS,))[0]
    for family in {family for _, _, family in LAYOUTS.values()}:
        model = _our_model(family)
        expected = {i: generate(model, SOLO, [prompt], GenerationConfig(max_new_tokens=MAX_TOKENS[i])).token_ids[0]
                    for i, prompt in enumerate(PROMPTS)}
        for name in (name for name, layout in LAYOUTS.items() if layout[2] == family):
            order, done = results[name]
            what = f"{family} under {name}, arrival order {order}"
            assert set(done) == set(range(len(PROMPTS))) - {ABORTED}, what
            for request_id, tokens in done.items():
                assert tokens == expected[request_id], f"{what}: request {request_id} {tokens} != generate()"
