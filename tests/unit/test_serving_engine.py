"""The serving engine in one process (megamoe.serving): continuous batching over the paged KV cache against
generate() and transformers, per-request sampling, prefix caching, preemption, aborts, stop strings,
logprobs and bad requests. Tiny random HF models (tests/helpers/hf_models.py), built once per module."""

import dataclasses
import functools
import random
import re
from pathlib import Path

import pytest
import torch

from megamoe.hf.adapters import adapter_for
from megamoe.inference.generation import GenerationConfig, generate, left_padded_batch
from megamoe.inference.pipeline_forward import pipeline_logits
from megamoe.models import GPTMoEModel
from megamoe.models.hf_loading import load_logical_state
from megamoe.serving import Engine, EngineConfig, QueueFullError, SamplingParams
from megamoe.serving.block_pool import BlockPool
from megamoe.serving.prefix_cache import PrefixCache, chained_block_hashes
from megamoe.transformer.attention import PackedSegments, causal_attention, packed_attention
from tests.helpers.hf_models import V, hf_model
from tests.helpers.inference import NEW, PROMPTS, SAMPLING, SOLO, _our_model

pytestmark = pytest.mark.usefixtures("one_thread")     # tiny steps: two threads on a busy machine cost 10x

# GQA (qk norm, tied embeddings), MLA (DeepSeek-V3), sliding + full layers with sinks (gpt-oss), sliding
# window on every layer (Mixtral, window 5: blocks behind it are released).
FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"]


@functools.cache
def model(family):
    return _our_model(family)


@functools.cache
def reference(family):
    """generate()'s greedy tokens of PROMPTS (one left-padded batch), NEW each."""
    return generate(model(family), SOLO, PROMPTS, GenerationConfig(max_new_tokens=NEW)).token_ids


def hf_greedy(family):
    ids, mask = left_padded_batch(PROMPTS)
    with torch.no_grad():
        out = hf_model(family)[0].generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=NEW,
                                           min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def engine_for(family, **config):
    config = {"block_size": 4, "kv_cache_memory": 1 << 20, **config}
    return Engine(model(family), SOLO, EngineConfig(**config))


def drive(engine, arrivals, on_step=None):
    """Add each (step, request id, prompt, params) at its step, run to the end: {id: final output}."""
    pending, finished, step = sorted(arrivals, key=lambda a: a[0]), {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if on_step is not None:
            on_step(engine)
        step += 1
    return finished


def random_arrivals(seed, params_of):
    """PROMPTS in a random order, each arriving at a random step of the first few."""
    rng = random.Random(seed)
    order = list(range(len(PROMPTS)))
    rng.shuffle(order)
    return [(rng.randrange(4), i, PROMPTS[i], params_of(i)) for i in order]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_generate_and_transformers(family):
    """Every request's greedy tokens equal generate()'s and transformers' for random arrival orders, token
    budgets (chunked prefill: a 7-token prompt over several steps next to decodes) and block sizes."""
    expected = reference(family)
    assert expected == hf_greedy(family)
    freed = []

    def released_behind_window(engine):
        freed.append(sum(None in r.block_table for r in engine.scheduler.running))

    for seed, budget, block_size in ((0, 3, 4), (1, 64, 2)):
        engine = engine_for(family, block_size=block_size, max_num_batched_tokens=budget)
        out = drive(engine, random_arrivals(seed, lambda i: SamplingParams(max_tokens=NEW)), released_behind_window)
        assert [out[i].token_ids for i in range(len(PROMPTS))] == expected, (family, seed)
        assert all(out[i].finish_reason == "length" and out[i].num_prompt_tokens == len(PROMPTS[i])
                   for i in out)
        metrics = engine.metrics()
        assert metrics.kv_blocks_used == 0 and metrics.running == metrics.waiting == 0
        assert metrics.generated_tokens == NEW * len(PROMPTS)
    # Mixtral: every layer slides (window 5), so blocks behind the window were released while running.
    assert (max(freed) > 0) == (family == "mixtral")


def test_sliding_window_layers_serve_sequences_longer_than_the_pool():
    """Mixtral (window 5 on every layer): blocks behind the window are released, so a pool of 5 blocks of 2
    positions serves 13-position sequences with generate()'s tokens, prefix-cache hits included."""
    family = "mixtral"
    probe = engine_for(family, block_size=2)
    per_block = probe.cache.nbytes // probe.cache.num_blocks
    engine = engine_for(family, block_size=2, kv_cache_memory=5 * per_block, max_num_batched_tokens=3)
    assert engine.cache.num_blocks == 5
    out = drive(engine, [(0, i, p, SamplingParams(max_tokens=NEW)) for i, p in enumerate(PROMPTS)])
    assert [out[i].token_ids for i in range(len(PROMPTS))] == reference(family)
    # A 12-token prompt twice (8 blocks): the second finds its 5 leading blocks cached but takes only the 2
    # inside the window of its first query (position 10).
    engine = engine_for(family, block_size=2, kv_cache_memory=8 * per_block, max_num_batched_tokens=3)
    prompt = [(5 * i + 2) % V for i in range(12)]
    expected = generate(model(family), SOLO, [prompt], GenerationConfig(max_new_tokens=2)).token_ids[0]
    assert drive(engine, [(0, 10, prompt, SamplingParams(max_tokens=2))])[10].token_ids == expected
    engine.add_request(11, prompt, SamplingParams(max_tokens=2))
    engine.step()
    assert engine.scheduler.running[0].block_table[:5] == [None] * 3 + engine.scheduler.running[0].block_table[3:5]
    assert None not in engine.scheduler.running[0].block_table[3:] and engine.metrics().kv_blocks_used == 3
    assert [t for o in engine.run() for t in o.new_token_ids] == expected[1:]
    assert engine.metrics().prefix_cache_hits == 10


@functools.cache
def sliding_and_full():
    """gpt-oss's first two layers (sliding with window 4, full): as many sliding as full layers, so the
    sliding one gets its own block table."""
    hf, config = hf_model("gpt_oss")
    logical = adapter_for("gpt_oss").hf_to_megamoe(hf.state_dict(), config)
    config = dataclasses.replace(config, num_layers=2, moe_layer_ids=(0, 1), sliding_window_layer_ids=(0,))
    model = GPTMoEModel(config, SOLO)
    load_logical_state(model, {k: v for k, v in logical.items() if not k.startswith("layers.2.")})
    return model


def test_mixed_sliding_and_full_layers_release_the_sliding_blocks_behind_the_window():
    """The sliding layer's blocks (their own table) behind the window are released while the requests run,
    so the pool's used blocks are the full layer's plus at most a window's worth per request; the tokens
    are generate()'s, prefix-cache hits included."""
    model = sliding_and_full()
    expected = generate(model, SOLO, PROMPTS, GenerationConfig(max_new_tokens=NEW)).token_ids
    engine = Engine(model, SOLO, EngineConfig(block_size=2, kv_cache_memory=1 << 20, max_num_batched_tokens=3))
    assert engine.cache.split_window == 4
    steps = []

    def count(engine):
        running = engine.scheduler.running
        steps.append((engine.metrics().kv_blocks_used, sum(len(r.block_table) for r in running),
                      [sum(b is not None for b in r.window_table) for r in running],
                      sum(r.window_table.count(None) for r in running)))
    out = drive(engine, random_arrivals(0, lambda i: SamplingParams(max_tokens=NEW)), count)
    assert [out[i].token_ids for i in range(len(PROMPTS))] == expected
    for used, full, live, _ in steps[:-1]:
        # each request: at most the blocks of window - 1 + 3 step tokens, plus one where they start mid-block
        assert used == full + sum(live) and all(0 < n <= 4 for n in live), steps
    assert max(released for *_, released in steps) > 0 and steps[-1][0] == 0, steps
    # A 12-token prompt twice (6 blocks): the second finds 5 full-layer blocks and the sliding blocks inside the
    # window of its first query (position 10), cached by the first although it released them.
    prompt = [(5 * i + 2) % V for i in range(12)]
    expected = generate(model, SOLO, [prompt], GenerationConfig(max_new_tokens=2)).token_ids[0]
    assert drive(engine, [(0, 10, prompt, SamplingParams(max_tokens=2))])[10].token_ids == expected
    engine.add_request(11, prompt, SamplingParams(max_tokens=2))
    engine.step()
    request = engine.scheduler.running[0]
    assert request.window_table[:3] == [None] * 3 and None not in request.window_table[3:] + request.block_table
    assert [t for o in engine.run() for t in o.new_token_ids] == expected[1:]
    assert engine.metrics().prefix_cache_hits == 10


def test_seeded_sampling_equals_generate_whatever_the_batch():
    """Seeded sampling = generate(..., request_ids=[id]) with the same seed, for requests mixed with greedy
    ones in the same steps."""
    family = "qwen3_moe"
    ids = [7, 11, 3, 5]
    expected = generate(model(family), SOLO, PROMPTS, GenerationConfig(max_new_tokens=NEW, sampling=SAMPLING),
                        request_ids=ids).token_ids
    sampled = SamplingParams(temperature=SAMPLING.temperature, top_k=SAMPLING.top_k, top_p=SAMPLING.top_p,
                             seed=SAMPLING.seed, max_tokens=NEW)
    arrivals = [(step, ids[i], p, sampled) for step, i, p, _ in random_arrivals(2, lambda i: None)]
    arrivals += [(1, 100 + i, p, SamplingParams(max_tokens=NEW)) for i, p in enumerate(PROMPTS)]   # greedy company
    out = drive(engine_for(family, max_num_batched_tokens=6), arrivals)
    assert [out[r].token_ids for r in ids] == expected
    assert [out[100 + i].token_ids for i in range(len(PROMPTS))] == reference(family)
    assert expected != reference(family)                       # sampling did change the tokens


def test_prefix_cache_prefills_a_shared_system_prompt_once():
    family = "qwen3_moe"
    system = [3, 14, 15, 9, 26, 5, 35, 8]                           # two full blocks of 4
    prompts = [system + p for p in PROMPTS]
    expected = generate(model(family), SOLO, prompts, GenerationConfig(max_new_tokens=4)).token_ids
    runs = {}
    for caching in (True, False):
        engine = engine_for(family, enable_prefix_caching=caching)
        first = drive(engine, [(0, 0, prompts[0], SamplingParams(max_tokens=4))])
        rest = drive(engine, [(0, i, p, SamplingParams(max_tokens=4)) for i, p in enumerate(prompts) if i])
        out = {**first, **rest}
        assert [out[i].token_ids for i in range(len(prompts))] == expected, caching
        runs[caching] = engine.metrics()
        if caching:
            assert first[0].num_cached_tokens == 0
            assert all(rest[i].num_cached_tokens == len(system) for i in rest)
    cached, uncached = runs[True], runs[False]
    assert cached.prefix_cache_hits == len(system) * (len(prompts) - 1)
    assert cached.prefix_cache_queries == sum(map(len, prompts))
    assert uncached.prefix_cache_hits == uncached.prefix_cache_queries == 0
    assert uncached.prompt_tokens_computed - cached.prompt_tokens_computed == cached.prefix_cache_hits


@pytest.mark.parametrize("budget", [512, 6])      # the shared blocks prefilled in one step, or over two
def test_requests_admitted_together_share_their_common_prefix(budget):
    """Two requests with one system prompt arriving in the same step: the second waits for the first to
    compute the shared blocks and takes them from the prefix cache; a third, unrelated one is not held back."""
    family = "qwen3_moe"
    system = [3, 14, 15, 9, 26, 5, 35, 8]                           # two full blocks of 4
    prompts = [system + [40, 2], system + [7], PROMPTS[1]]
    expected = generate(model(family), SOLO, prompts, GenerationConfig(max_new_tokens=4)).token_ids
    runs, first_step = {}, {}
    for caching in (True, False):
        engine = engine_for(family, enable_prefix_caching=caching, max_num_batched_tokens=budget)
        running = []
        out = drive(engine, [(0, i, p, SamplingParams(max_tokens=4)) for i, p in enumerate(prompts)],
                    on_step=lambda e: running.append(sorted(r.request_id for r in e.scheduler.running)))
        assert [out[i].token_ids for i in range(len(prompts))] == expected, caching
        runs[caching], first_step[caching] = (engine.metrics(), out), running[0]
    (cached, out), (uncached, _) = runs[True], runs[False]
    assert (out[0].num_cached_tokens, out[1].num_cached_tokens, out[2].num_cached_tokens) == (0, len(system), 0)
    assert cached.prefix_cache_hits == len(system)
    assert uncached.prompt_tokens_computed - cached.prompt_tokens_computed == len(system)
    if budget == 512:       # the unrelated request starts at once; the one sharing the prefix a step later
        assert first_step == {True: [0, 2], False: [0, 1, 2]}


def test_eplb_interval_runs_a_rebalancing_round_every_n_steps():
    """A round after every second step (one EP rank: nothing to move; EP 2 with replicas moving experts is
    tests/multirank/test_serving_layouts.py), the tokens unchanged."""
    engine = engine_for("qwen3_moe", eplb_interval=2)
    rounds = []
    out = drive(engine, random_arrivals(0, lambda i: SamplingParams(max_tokens=NEW)),
                on_step=lambda e: rounds.append(len(e.rebalancer.reports)))
    assert [out[i].token_ids for i in range(len(PROMPTS))] == reference("qwen3_moe")
    assert rounds == [step // 2 for step in range(1, len(rounds) + 1)] and rounds[-1] > 0, rounds
    assert not any(report.layers for report in engine.rebalancer.reports)


def test_preemption_with_a_tiny_pool_keeps_every_token():
    """A pool of 8 blocks of 2 positions for 6 requests of up to 13 positions: running requests are preempted
    (recomputed later, sampling generators kept) and every token is still the same."""
    family = "deepseek_v3"
    greedy = reference(family)
    ids = [7, 11, 3, 5]
    sampled_ref = generate(model(family), SOLO, PROMPTS, GenerationConfig(max_new_tokens=NEW, sampling=SAMPLING),
                           request_ids=ids).token_ids
    sampled = SamplingParams(temperature=SAMPLING.temperature, top_k=SAMPLING.top_k, top_p=SAMPLING.top_p,
                             seed=SAMPLING.seed, max_tokens=NEW)
    probe = engine_for(family, block_size=2)
    per_block = probe.cache.nbytes // probe.cache.num_blocks
    engine = engine_for(family, block_size=2, kv_cache_memory=9 * per_block - 1, max_num_batched_tokens=8)
    assert engine.cache.num_blocks == 8
    used = []
    arrivals = [(0, i, p, SamplingParams(max_tokens=NEW)) for i, p in enumerate(PROMPTS)]
    arrivals += [(0, ids[i], p, sampled) for i, p in enumerate(PROMPTS) if i % 2]
    out = drive(engine, arrivals, lambda e: used.append(e.metrics().kv_blocks_used))
    assert [out[i].token_ids for i in range(len(PROMPTS))] == greedy
    assert [out[ids[i]].token_ids for i in (1, 3)] == [sampled_ref[1], sampled_ref[3]]
    assert engine.metrics().preemptions > 0 and max(used) <= 8


def test_a_long_prompt_never_stalls_running_decodes():
    """Chunked prefill: while a 40-token prompt is prefilled under a budget of 8 tokens per step, both running
    requests get a token every step (6 prompt tokens go with their 2 decodes); a finished request's blocks
    are released in the step that ends it (the pool holds exactly the running requests' blocks after every
    step); every request's tokens are still generate()'s."""
    family = "qwen3_moe"
    long_prompt = [(7 * i + 3) % V for i in range(40)]
    expected = generate(model(family), SOLO, [long_prompt], GenerationConfig(max_new_tokens=3)).token_ids[0]
    engine = engine_for(family, max_num_batched_tokens=8, enable_prefix_caching=False)
    engine.add_request(0, PROMPTS[1], SamplingParams(max_tokens=NEW + 2))   # ends in the step after the prefill
    engine.add_request(1, PROMPTS[3], SamplingParams(max_tokens=NEW + 4))
    engine.step()                                              # both prompts (2 + 4 tokens) in one step
    engine.add_request(2, long_prompt, SamplingParams(max_tokens=3))
    out, step = {}, 0
    while engine.has_unfinished():
        outputs = {o.request_id: o for o in engine.step()}
        step += 1
        if step < 7:                                           # 40 = 6 x 6 + 4 prompt tokens
            assert sorted(outputs) == [0, 1] and engine.scheduler.running[-1].num_computed == 6 * step
        held = {b for r in engine.scheduler.running for b in r.block_table}
        assert engine.metrics().kv_blocks_used == len(held)
        out.update(outputs)
    assert out[0].finish_reason == "length" and out[0].token_ids[:NEW] == reference(family)[1]
    assert out[1].token_ids[:NEW] == reference(family)[3] and out[2].token_ids == expected


def test_max_num_seqs_bounds_the_running_requests():
    running = []
    engine = engine_for("qwen3_moe", max_num_seqs=2)
    out = drive(engine, [(0, i, p, SamplingParams(max_tokens=NEW)) for i, p in enumerate(PROMPTS)],
                lambda e: running.append(e.metrics().running))
    assert max(running) == 2 and [out[i].token_ids for i in range(len(PROMPTS))] == reference("qwen3_moe")


def test_abort_frees_blocks_at_once():
    engine = engine_for("qwen3_moe")
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(i, prompt, SamplingParams(max_tokens=NEW))
    engine.step()
    engine.step()
    both = engine.metrics().kv_blocks_used
    engine.abort(0)
    assert engine.metrics().kv_blocks_used == both - 2 and engine.metrics().running == 1   # 7 + 2 positions
    engine.abort(12345)                                       # unknown (or finished): ignored
    outputs = engine.step()
    aborted = [o for o in outputs if o.request_id == 0]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert [o.request_id for o in outputs if o.request_id != 0] == [1]
    engine.abort(1)                                           # a waiting request too
    engine.add_request(2, PROMPTS[2], SamplingParams(max_tokens=NEW))
    engine.abort(2)
    assert engine.metrics().kv_blocks_used == 0 and engine.metrics().waiting == 0
    assert sorted(o.request_id for o in engine.step()) == [1, 2] and not engine.has_unfinished()


class CharTokenizer:
    """Token t decodes to a letter; tokens >= 60 are "special" (skipped)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t % 26) for t in ids if not (skip_special_tokens and t >= 60))


def test_stop_strings_and_stop_token_ids():
    family = "gpt_oss"
    free_run = reference(family)
    decode = functools.partial(CharTokenizer().decode, skip_special_tokens=True)
    stop = decode(free_run[0])[1:3]
    ends = next(n for n in range(len(free_run[0]) + 1) if stop in decode(free_run[0][:n]))   # the token completing it
    assert ends < NEW
    engine = Engine(model(family), SOLO, EngineConfig(block_size=4, kv_cache_memory=1 << 20),
                    tokenizer=CharTokenizer())
    stop_token = free_run[1][2]
    out = drive(engine, [(0, 0, PROMPTS[0], SamplingParams(max_tokens=NEW, stop=("zzzz", stop))),
                         (0, 1, PROMPTS[1], SamplingParams(max_tokens=NEW, stop_token_ids=(stop_token,)))])
    assert out[0].finish_reason == "stop" and out[0].stop_reason == stop
    assert out[0].token_ids == free_run[0][:ends]
    cut = free_run[1].index(stop_token) + 1
    assert out[1].finish_reason == "stop" and out[1].stop_reason == stop_token and out[1].token_ids == free_run[1][:cut]


def test_logprobs_are_log_softmax_of_the_reference_logits():
    """The log-probability of each sampled token (one per new token, step by step) is the log-softmax of the
    full-sequence forward's logits there (before temperature)."""
    family = "deepseek_v3"
    engine = engine_for(family, max_num_batched_tokens=5)
    params = SamplingParams(max_tokens=NEW, logprobs=True, temperature=0.7, seed=1)
    tokens, logprobs = {0: [], 1: []}, {0: [], 1: []}
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(i, p, params)
    engine.add_request(2, PROMPTS[2], SamplingParams(max_tokens=2))
    for output in engine.run():
        if output.request_id == 2:
            assert output.logprobs is None                     # not asked
            continue
        assert len(output.logprobs) == len(output.new_token_ids) == 1
        tokens[output.request_id] += output.new_token_ids
        logprobs[output.request_id] += output.logprobs
    for i in range(2):
        ids = torch.tensor([PROMPTS[i] + tokens[i][:-1]])
        logits = pipeline_logits(model(family), SOLO, ids)[0, len(PROMPTS[i]) - 1:]
        expected = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(tokens[i])[:, None]).squeeze(1)
        assert len(tokens[i]) == NEW
        torch.testing.assert_close(torch.tensor(logprobs[i], dtype=torch.float64), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, V], SamplingParams(), r"token ids \[64\] outside the vocabulary"),
    ([1] * 60, SamplingParams(max_tokens=8), "more than the model's context of 64: at most 4 new tokens"),
    ([1, 2], SamplingParams(stop_token_ids=(V,)), "stop_token_ids"),
    ([1, 2], SamplingParams(stop=("x",)), "needs the engine's tokenizer"),
    ("12", SamplingParams(), "list of integer token ids"),
])
def test_bad_requests_raise_value_error_naming_the_problem(prompt, params, match):
    engine = engine_for("qwen3_moe")
    with pytest.raises(ValueError, match=match):
        engine.add_request(0, prompt, params)
    assert not engine.has_unfinished()


def test_bad_settings_queue_and_pool_limits():
    engine = engine_for("qwen3_moe", max_waiting=2, kv_cache_memory=None, kv_cache_memory_fraction=1e-6)
    engine.add_request(0, [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="request_id 0 is already"):
        engine.add_request(0, [1, 2], SamplingParams())
    engine.add_request(1, [1, 2], SamplingParams())
    with pytest.raises(QueueFullError, match="max_waiting"):
        engine.add_request(2, [1, 2], SamplingParams())
    small = engine_for("qwen3_moe", kv_cache_memory=engine.cache.nbytes // engine.cache.num_blocks * 3)
    with pytest.raises(ValueError, match=r"needs 4 KV blocks, more than the whole KV cache holds \(3 blocks of 4 positions\)"):
        small.add_request(0, [1] * 10, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_memory .* holds no KV block"):
        engine_for("qwen3_moe", kv_cache_memory=10)
    for field, value in (("block_size", 0), ("max_num_batched_tokens", 0), ("max_num_seqs", True),
                         ("kv_cache_memory_fraction", 0), ("kv_cache_memory", -1), ("speculative_tokens", -1),
                         ("eplb_interval", -1), ("eplb_interval", 1.5)):
        with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
            EngineConfig(**{field: value})
    for field, value in (("temperature", -1.0), ("temperature", "hot"), ("top_p", None), ("top_k", 0), ("top_k", 2.5), ("top_p", 0.0), ("seed", -1), ("max_tokens", 0),
                         ("stop_token_ids", (-1,)), ("stop", ("",)), ("logprobs", 1)):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**{field: value})


@pytest.mark.parametrize("window, sinks", [(None, False), (3, True)])
def test_packed_attention_equals_each_request_alone(window, sinks):
    """Three requests in one row, two decoding (5 and 2 keys) around a prefill chunk (3 queries over 6 keys):
    each query's output equals causal_attention over its own request's keys alone (GQA 4 / 2 heads)."""
    g = torch.Generator().manual_seed(0)
    lengths, queries = [5, 6, 2], [1, 3, 1]
    keys = [torch.randn(1, 2, n, 8, generator=g) for n in lengths]
    values = [torch.randn(1, 2, n, 6, generator=g) for n in lengths]
    qs = [torch.randn(1, 4, n, 8, generator=g) for n in queries]
    sink = torch.randn(4, generator=g) if sinks else None
    segments, q0, k0 = [], 0, 0
    for n_q, n_k in zip(queries, lengths):
        segments.append((q0, n_q, k0, n_k))
        q0, k0 = q0 + n_q, k0 + n_k
    out = packed_attention(torch.cat(qs, 2), torch.cat(keys, 2), torch.cat(values, 2), 0.3,
                           PackedSegments.build(segments), window, sink)
    alone = torch.cat([causal_attention(q, k, v, 0.3, window, sinks=sink) for q, k, v in zip(qs, keys, values)], 2)
    torch.testing.assert_close(out, alone, atol=1e-6, rtol=0)


def test_pack_step_equals_the_per_chunk_slots():
    """The vectorized step packing against the slots written out position by position: full and sliding windows,
    a split window table, chunks across block boundaries, unallocated (None) blocks behind a window."""
    from megamoe.serving.paged_kv_cache import ScheduledChunk, pack_step
    block = 4
    chunks = [ScheduledChunk([3, 7, 1], 2, 7, [None, 5, 2]), ScheduledChunk([9], 0, 1, [6]),
              ScheduledChunk([None, None, 4, 8, 11], 17, 1, [None, None, None, 12, 13]),
              ScheduledChunk([0, 10], 5, 3, [14, 15])]

    def slot(table, position):          # an unallocated block reads as -1 (never read by a query in a real step)
        number = table[position // block]
        return (-1 if number is None else number) * block + position % block

    windows = {None, 3}
    for split in (None, 3):
        writes, packed = pack_step(chunks, block, windows, "cpu", split_window=split)
        queries = 0
        keys = dict.fromkeys(windows, 0)
        want_writes, want_gathers = {w: [] for w in windows}, {w: [] for w in windows}
        want_segments = {w: [] for w in windows}
        for chunk in chunks:
            end = chunk.start + chunk.count
            for window in windows:
                table = chunk.window_table if split is not None and window == split else chunk.block_table
                first = 0 if window is None else max(0, chunk.start - window + 1)
                want_writes[window] += [slot(table, p) for p in range(chunk.start, end)]
                want_gathers[window] += [slot(table, p) for p in range(first, end)]
                want_segments[window].append((queries, chunk.count, keys[window], end - first))
                keys[window] += end - first
            queries += chunk.count
        for window in windows:
            assert writes[window].tolist() == want_writes[window], (split, window)
            assert packed[window].gather_slots.tolist() == want_gathers[window], (split, window)
            assert packed[window].segments.segments == tuple(want_segments[window]), (split, window)


def test_block_pool_shares_and_evicts_least_recently_used():
    cache = PrefixCache()
    pool = BlockPool(3, cache)
    a, b = pool.allocate(2)
    keys = chained_block_hashes([1, 2, 3, 4, 5], 2, [])
    assert len(keys) == 2 and chained_block_hashes([9, 2, 3, 4], 2, [])[1] != keys[1]   # keyed by the whole prefix
    cache.insert(a, keys[0])
    cache.insert(b, keys[1])
    pool.acquire(a)                                            # a second request shares block a
    pool.release([b, a])
    assert pool.num_used == 1 and cache.lookup(keys) == [a, b]
    pool.release([a])                                          # unreferenced: cached, evictable (b older)
    assert pool.num_used == 0 and pool.num_free == 3
    c, d = pool.allocate(2)                                    # the free block, then the LRU one (b)
    assert d == b and cache.lookup(keys) == [a]
    assert pool.allocate(2) is None and pool.num_free == 1     # nothing taken when short
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([c, c])


def test_the_docs_example_runs_as_written():
    """The python block of docs/serving_engine.md (a random tiny Qwen3-MoE): both requests get their 8 tokens."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "serving_engine.md").read_text()
    namespace = {}
    exec(re.search(r"```python\n(.*?)```", page, re.S).group(1), namespace)
    assert {i: len(ids) for i, ids in namespace["finished"].items()} == {0: 8, 1: 8}
    assert namespace["engine"].metrics().kv_blocks_used == 0
