"""Generation with a KV cache (megamoe.inference): greedy generation from tiny random HF models of every
family yields exactly transformers' generate() token ids for a batch of prompts of different lengths,
single process and under several parallel layouts (EP with replicated slots, PP=2, ETP=2, data-parallel
attention with uneven requests incl. a rank with none, a checkpoint resharded on load); seeded
sampling is identical across layouts; the expert load recorded during generation counts real tokens
only and round-trips through the expert-load file into a balanced placement; uneven gathers and
reduce-scatters; the example script on a checkpoint converted by megamoe-convert, whose import-hf
--expert-load takes the load file the script records; generation refuses what it cannot do (positions
past max_position_embeddings, stop tokens outside the vocabulary, a non-finite temperature, a negative
seed), and the generation memory estimate equals the KV caches' and parameters' bytes.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.checkpoint.format import save_checkpoint
from megamoe.checkpoint.model_loading import build_model_from_checkpoint
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.hf.adapters import adapter_for
from megamoe.inference.expert_load import gather_expert_load, reset_expert_load
from megamoe.inference.generation import GenerationConfig, generate, left_padded_batch, max_sequence_length
from megamoe.inference.generation_memory import estimate_generation_memory
from megamoe.inference.kv_cache import StaticKVCache
from megamoe.inference.sampling import SamplingConfig, request_generator, sample_next_tokens
from megamoe.models import GPTMoEModel
from megamoe.models.families import SUPPORTED_FAMILIES
from megamoe.models.hf_loading import load_logical_state
from megamoe.moe.placement.expert_slots import ExpertPlacement, load_expert_load, save_expert_load
from megamoe.spawned_ranks import run_on_ranks
from megamoe.transformer import MultiHeadLatentAttention
from megamoe.transformer.mla import MLAConfig
from megamoe.transformer.rope import RopeConfig
from parallel_state import ParallelState
from test_hf_families import V, hf_model   # tiny random HF models of every family (E=8, K=2)

PROMPTS = [[5, 9, 12, 3, 40, 7, 1], [22, 8], [33, 17, 60, 2, 9], [11, 4, 4, 50]]   # different lengths
NEW = 6
SAMPLING = SamplingConfig(temperature=0.9, top_k=20, top_p=0.95, seed=3)
SOLO = ParallelState.single_process()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _our_model(family, state=SOLO, **moe_fields):
    hf, config = hf_model(family)
    if moe_fields:
        config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, **moe_fields))
    model = GPTMoEModel(config, state)
    load_logical_state(model, adapter_for(family).hf_to_megamoe(hf.state_dict(), config))
    return model


def _hf_generate(hf, prompts, max_new_tokens, stop_id):
    """transformers' greedy generate() on the left-padded batch; each row cut after its stop token."""
    ids, mask = left_padded_batch(prompts)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=stop_id, pad_token_id=0)
    rows = []
    for new in out[:, ids.shape[1]:].tolist():
        rows.append(new[:new.index(stop_id) + 1] if stop_id in new else new)
    return rows


def _stop_token(family):
    """A token the model generates for some prompt at step >= 2 and not before, so stopping at it
    changes the output: (token, that prompt's index, the unstopped generations)."""
    free_run = generate(_our_model(family), SOLO, PROMPTS, GenerationConfig(max_new_tokens=NEW)).token_ids
    return next((t, row) for row, ids in enumerate(free_run) for i, t in enumerate(ids)
                if i >= 2 and t not in ids[:i]) + (free_run,)


# ----------------------------------------------------------------------------------------------
# Single process
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_greedy_matches_transformers(family):
    stop, stopped_row, free_run = _stop_token(family)
    model = _our_model(family)
    reset_expert_load(model)
    out = generate(model, SOLO, PROMPTS, GenerationConfig(max_new_tokens=NEW, stop_token_ids=(stop,)))
    expected = _hf_generate(hf_model(family)[0], PROMPTS, NEW, stop)
    assert out.token_ids == expected, f"{family}: {out.token_ids} != transformers {expected}"
    assert out.finish_reasons[stopped_row] == "stop" and len(out.token_ids[stopped_row]) < NEW
    for row, new in enumerate(out.token_ids):            # stopping only truncates
        assert free_run[row][:len(new)] == new
        assert out.finish_reasons[row] == ("stop" if new[-1] == stop else "length")
    # Expert load: K pairs per real token fed (prompt + new tokens but the last); padding not counted.
    fed = sum(len(p) + len(new) - 1 for p, new in zip(PROMPTS, out.token_ids))
    top_k = model.config.moe.router.top_k
    for layer_id, layer in model.moe_layers().items():
        assert int(layer.load_counter.per_expert.sum()) == top_k * fed, layer_id
    assert out.prompt_tokens == sum(map(len, PROMPTS)) and out.decode_steps == max(map(len, out.token_ids)) - 1
    assert out.decode_tokens_per_second > 0 and out.prefill_tokens_per_second > 0


@pytest.mark.slow      # one torch.compile per family, ~15 s each
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
def test_compiled_decoding_matches_eager(family):
    """generate(compiled=True): the same tokens, stop reasons and expert load as eager decoding, for a
    left-padded batch with a row that stops early (then runs on as padding), with replicated expert
    slots (MLA, shared experts, group-limited routing, a dense first layer for DeepSeek-V3; a gated
    shared expert for Qwen2-MoE); the step is one graph, and later calls with another cache length or
    batch size reuse it; the time spent compiling is reported."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    stop = _stop_token(family)[0]
    model = _our_model(family, num_expert_slots=2 * hf_model(family)[1].moe.router.num_experts)
    config = GenerationConfig(max_new_tokens=NEW, stop_token_ids=(stop,))
    runs = {}
    for compiled in (False, True):
        reset_expert_load(model)
        out = generate(model, SOLO, PROMPTS, config, compiled=compiled)
        runs[compiled] = out, {i: layer.load_counter.per_expert.clone() for i, layer in model.moe_layers().items()}
    (eager, eager_load), (compiled, compiled_load) = runs[False], runs[True]
    assert compiled.token_ids == eager.token_ids and compiled.finish_reasons == eager.finish_reasons
    assert "stop" in compiled.finish_reasons and compiled.decode_steps == eager.decode_steps > 0
    assert eager.compile_seconds == 0 and 0 < compiled.compile_seconds <= compiled.decode_seconds
    # The compiling steps made tokens too (one per request still running), left out of the tokens/s.
    assert eager.compile_tokens == 0 and 0 < compiled.compile_tokens < compiled.decode_tokens
    for layer_id in eager_load:
        assert torch.equal(compiled_load[layer_id], eager_load[layer_id]), layer_id
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > 0, "nothing was compiled"
    # One graph per step: the MoE layers took the per-pair path (the grouped one is never traced).
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    shorter = GenerationConfig(max_new_tokens=NEW - 2)
    again = generate(model, SOLO, PROMPTS, shorter, compiled=True)
    assert again.token_ids == generate(model, SOLO, PROMPTS, shorter).token_ids
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "another cache length recompiled"
    assert again.compile_seconds == 0
    fewer = generate(model, SOLO, PROMPTS[:3], shorter, compiled=True)     # another batch size
    assert fewer.token_ids == generate(model, SOLO, PROMPTS[:3], shorter).token_ids
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "another batch size recompiled"


def test_left_padded_batch():
    ids, mask = left_padded_batch([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]


def test_padding_and_batching_do_not_change_results():
    """Each prompt alone, or in a batch (left-padded), or after requests that stop early: same tokens;
    sampled tokens depend on (seed, request id) only, not on the batch."""
    model = _our_model("deepseek_v3")
    config = GenerationConfig(max_new_tokens=5)
    batched = generate(model, SOLO, PROMPTS, config).token_ids
    alone = [generate(model, SOLO, [p], config).token_ids[0] for p in PROMPTS]
    assert batched == alone
    sampled = GenerationConfig(max_new_tokens=5, sampling=SAMPLING)
    forward = generate(model, SOLO, PROMPTS, sampled, request_ids=[10, 11, 12, 13]).token_ids
    backward = generate(model, SOLO, PROMPTS[::-1], sampled, request_ids=[13, 12, 11, 10]).token_ids
    assert forward == backward[::-1]
    assert forward != generate(model, SOLO, PROMPTS, sampled).token_ids       # other ids, other draws
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, SOLO, [[1], []], config)
    with pytest.raises(ValueError, match=f"outside the vocabulary \\[0, {V}\\)"):
        generate(model, SOLO, [[1, V]], config)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
            GenerationConfig(max_new_tokens=bad)


def test_generation_refuses_what_it_cannot_do():
    """Before anything is allocated: a prompt, or a prompt with its new tokens, past the model's
    max_position_embeddings (64 here), a stop token outside the vocabulary or negative. The last fitting
    length generates. Dynamic-NTK rope and a model declaring no positions have no limit."""
    model = _our_model("qwen3_moe")
    assert max_sequence_length(model.config) == 64
    with pytest.raises(ValueError, match=r"prompt 1 \(65 tokens\).* more than the model's 64 "
                                         r"\(max_position_embeddings\): shorten it to at most 63 tokens"):
        generate(model, SOLO, [[1], [1] * 65], GenerationConfig(max_new_tokens=1))
    with pytest.raises(ValueError, match=r"prompt 0 \(60 tokens\) with GenerationConfig.max_new_tokens 5 needs 65 "
                                         r"positions.*at most 4 new tokens fit after it"):
        generate(model, SOLO, [[1] * 60], GenerationConfig(max_new_tokens=5))
    out = generate(model, SOLO, [[1] * 59], GenerationConfig(max_new_tokens=5))
    assert len(out.token_ids[0]) == 5
    with pytest.raises(ValueError, match=f"stop_token_ids \\[{V}\\] are outside the model's vocabulary"):
        generate(model, SOLO, [[1, 2]], GenerationConfig(max_new_tokens=2, stop_token_ids=(2, V)))
    with pytest.raises(ValueError, match=r"stop_token_ids \[-1\] are negative"):
        GenerationConfig(stop_token_ids=(-1,))
    rope = model.config.attention.rope
    for other, limit in ((dataclasses.replace(rope, rope_type="dynamic", factor=2.0), None),
                         (dataclasses.replace(rope, max_position_embeddings=None), None)):
        config = dataclasses.replace(model.config, attention=dataclasses.replace(model.config.attention, rope=other))
        assert max_sequence_length(config) == limit


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])     # GQA; MLA (latent + rope key)
def test_generation_memory_estimate_is_the_caches_and_parameters(family):
    """estimate_generation_memory: the KV caches' bytes after a prefill into caches of the full length,
    and the model's parameter bytes (the routed experts' apart)."""
    model = _our_model(family)
    batch, prompt, new = 3, 5, 7
    caches = {int(i): StaticKVCache(prompt + new) for i in model.layers}
    ids = torch.randint(0, V, (batch, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.run_layers(ids, None, caches, torch.ones(batch, prompt, dtype=torch.bool))
    estimate = estimate_generation_memory(model.config, batch=batch, sequence_length=prompt + new)
    assert estimate.kv_cache_bytes == sum(cache.nbytes for cache in caches.values()) > 0
    parameters = dict(model.named_parameters())
    assert estimate.param_bytes == sum(p.numel() * p.element_size() for p in parameters.values())
    assert estimate.expert_param_bytes == sum(p.numel() * p.element_size() for name, p in parameters.items()
                                              if ".mlp.experts." in name) > 0
    assert estimate.total == estimate.param_bytes + estimate.kv_cache_bytes


def test_sampling():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    assert sample_next_tokens(logits, SamplingConfig(), []).tolist() == [4, 0]          # greedy, first on ties
    everything = set(range(5))
    cases = (   # config, tokens each row can draw (tied scores all survive top-k; top-p breaks ties by id)
        (SamplingConfig(temperature=1.0, top_k=2), [{0, 4}, everything]),
        (SamplingConfig(temperature=1.0, top_p=0.5), [{4}, {0, 1, 2}]),
        (SamplingConfig(temperature=0.5, top_k=3, top_p=0.9), [{0, 4}, everything]),
    )
    generators = [request_generator(0, 0), request_generator(0, 1)]
    for config, allowed in cases:
        seen = [set(), set()]
        for _ in range(400):
            for row, token in enumerate(sample_next_tokens(logits, config, generators).tolist()):
                seen[row].add(token)
        assert seen == allowed, (config, seen)
    # Same seed and request id: same stream; another id: another stream.
    config = SamplingConfig(temperature=1.0)

    def draws(request_id):
        generator = request_generator(7, request_id)
        return [sample_next_tokens(logits[1:], config, [generator]).item() for _ in range(20)]
    assert draws(3) == draws(3) != draws(4)
    for bad in (dict(temperature=-1.0), dict(temperature=float("inf")), dict(temperature=float("nan")), dict(top_k=0),
                dict(top_k=2.5), dict(top_p=0.0), dict(top_p=1.5), dict(seed=-1), dict(seed=1.5)):
        with pytest.raises(ValueError, match=f"SamplingConfig.{next(iter(bad))}"):
            SamplingConfig(**bad)


def test_static_kv_cache_holds_mla_latents():
    """MLA caches the normed latent and the rotated rope key (not per-head K/V); a prefill + decode
    through the cache equals the full forward, and the cache refuses overflow and foreign shapes."""
    config = MLAConfig(hidden_size=32, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=6, rope=RopeConfig(dim=4))
    block = MultiHeadLatentAttention(config)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6).expand(2, 6)
    cache = StaticKVCache(max_length=6)
    with torch.no_grad():
        full = block(x, positions)
        steps = [block(x[:, :4], positions[:, :4], cache)] + [
            block(x[:, t:t + 1], positions[:, t:t + 1], cache) for t in (4, 5)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
    latent, rope_key = cache.buffers
    assert latent.shape == (2, 1, 6, 16) and rope_key.shape == (2, 1, 6, 4) and cache.length == 6
    assert cache.nbytes == 2 * 6 * (16 + 4) * 4
    with pytest.raises(ValueError, match="StaticKVCache is full"):
        cache.update(torch.zeros(2, 1, 1, 16), torch.zeros(2, 1, 1, 4))
    other = StaticKVCache(4)
    other.update(torch.zeros(2, 1, 1, 16), torch.zeros(2, 1, 1, 4))
    with pytest.raises(ValueError, match="holds entries of shape"):
        other.update(torch.zeros(3, 1, 1, 16), torch.zeros(3, 1, 1, 4))


# ----------------------------------------------------------------------------------------------
# Parallel layouts (4 ranks, one spawn)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
    sizes: dict                          # initialize_model_parallel arguments
    engine: dict                         # MoE engine fields (dispatcher, input_sharded)
    slots_per_expert: float = 1
    requests: tuple | None = None        # data-parallel attention: request ids per DP rank (None: all, everywhere)
    from_checkpoint: bool = False        # load the single-process checkpoint, resharded

    @property
    def dp_attention(self) -> bool:
        return self.requests is not None


SHARDED = dict(dispatcher="allgather", input_sharded=True)
LAYOUTS = {
    "pp2 tp2 ep2 allgather 2E slots": Layout(dict(pp=2, tp=2, ep=2), dict(dispatcher="allgather"), 2),
    "ep4 alltoall 1.5E slots, checkpoint": Layout(dict(ep=4), dict(dispatcher="alltoall"), 1.5, from_checkpoint=True),
    "tp2 etp2 ep2 alltoall": Layout(dict(tp=2, etp=2, ep=2), dict(dispatcher="alltoall")),
    "dp-attention ep4 allgather sharded": Layout(dict(ep=4), SHARDED, requests=([0, 1], [2], [], [3])),
    "dp-attention ep4 alltoall 2E slots": Layout(dict(ep=4), dict(dispatcher="alltoall"), 2,
                                                 requests=([3], [], [0, 2], [1])),
    "dp-attention tp2, ep2 over dp, allgather sharded": Layout(dict(tp=2, ep=2, order="tp-cp-dp-ep-pp"), SHARDED,
                                                               requests=([0, 1, 2, 3], [])),
}
SAMPLED_FAMILIES = ("deepseek_v2",)


def _check_uneven_collectives(group):
    """Gather / reduce-scatter with uneven row counts (one rank empty), forward and backward."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sizes = [3, 0, 2, 1][:world]
    x = torch.full((sizes[rank], 2), float(rank + 1), requires_grad=True)
    assert comms.all_gather_sizes(sizes[rank], group) == sizes
    gathered = comms.gather_from_sequence_parallel_region(x, group, sizes=sizes)
    assert torch.equal(gathered, torch.cat([torch.full((n, 2), float(r + 1)) for r, n in enumerate(sizes)]))
    (gathered * (rank + 1)).sum().backward()                  # reduce-scatter of the gradient
    assert torch.equal(x.grad, torch.full((sizes[rank], 2), float(sum(range(1, world + 1)))))
    y = torch.arange(sum(sizes) * 2, dtype=torch.float32).view(-1, 2).requires_grad_()
    scattered = comms.reduce_scatter_to_sequence_parallel_region(y, group, sizes=sizes)
    start = sum(sizes[:rank])
    assert torch.equal(scattered, world * y.detach()[start:start + sizes[rank]])
    scattered.sum().backward()                                # all-gather of the gradient
    assert torch.equal(y.grad, torch.ones_like(y))
    assert comms.all_gather_into(torch.zeros(0, 3), group, sizes=[0] * world).shape == (0, 3)
    with comms.comm_counter() as counter:                     # equal sizes: the plain, unpadded path
        comms.all_gather_into(torch.zeros(2, 3), group, sizes=[2] * world)
    assert counter.bytes("all_gather") == 2 * 3 * 4


def _layouts_worker(rank, world_size, cases, layouts, load_file):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    results = []
    for name, layout in layouts.items():
        state = initialize_model_parallel(**layout.sizes)
        if layout.engine.get("input_sharded"):
            _check_uneven_collectives(state.ep_etp.group)
        mine = list(layout.requests[state.dp.rank]) if layout.dp_attention else list(range(len(PROMPTS)))
        prompts = [PROMPTS[i] for i in mine]
        for family, config, logical, stop, checkpoint in cases:
            num_slots = int(layout.slots_per_expert * config.moe.num_experts)
            if layout.from_checkpoint:
                model = build_model_from_checkpoint(checkpoint, state, num_expert_slots=num_slots, **layout.engine)
            else:
                moe = dataclasses.replace(config.moe, num_expert_slots=num_slots, **layout.engine)
                model = GPTMoEModel(dataclasses.replace(config, moe=moe), state)
                load_logical_state(model, logical)
            placements = {str(i): layer.placement.to_dict() for i, layer in model.moe_layers().items()}
            reset_expert_load(model)
            greedy = generate(model, state, prompts, GenerationConfig(max_new_tokens=NEW, stop_token_ids=(stop,)),
                              request_ids=mine).token_ids
            load = gather_expert_load(model, state, data_parallel_attention=layout.dp_attention)
            if rank == 0 and family == cases[0][0] and name.startswith("dp-attention ep4 allgather"):
                save_expert_load(load_file, load, num_experts=config.moe.num_experts, metadata={"layout": name})
            sampled = None
            if family in SAMPLED_FAMILIES:
                sampled = generate(model, state, prompts, GenerationConfig(max_new_tokens=NEW, sampling=SAMPLING),
                                   request_ids=mine).token_ids
            results.append((name, family, mine, greedy, sampled, {i: n.tolist() for i, n in load.items()},
                            placements))
        destroy_model_parallel()
    return results


def _expected(family, checkpoint_dir):
    """The case a layout runs, and what it must reproduce: transformers' greedy ids, our single-process
    sampled ids and expert load. The checkpoint is saved single-process with, in its manifest, the
    balanced EP4 / 12-slot placement of that load, which the 4-rank layout of that shape must pick up."""
    hf, config = hf_model(family)
    stop = _stop_token(family)[0]
    model = _our_model(family)
    reset_expert_load(model)
    generate(model, SOLO, PROMPTS, GenerationConfig(max_new_tokens=NEW, stop_token_ids=(stop,)))
    load = gather_expert_load(model, SOLO, data_parallel_attention=False)
    placements = {str(i): ExpertPlacement.balanced(n, 12, 4).to_dict() for i, n in load.items()}
    path = os.path.join(checkpoint_dir, family)
    save_checkpoint(path, sharded_state_dict(model),
                    manifest_fields={"model_config": config.to_dict(), "expert_placement": placements})
    sampled = generate(model, SOLO, PROMPTS, GenerationConfig(max_new_tokens=NEW, sampling=SAMPLING)).token_ids
    logical = adapter_for(family).hf_to_megamoe(hf.state_dict(), config)
    expected = dict(greedy=_hf_generate(hf, PROMPTS, NEW, stop), sampled=sampled, placements=placements,
                    load={i: n.tolist() for i, n in load.items()})
    return (family, config, logical, stop, path), expected


def _compiled_layouts_worker(rank, world_size, family, layouts):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    results = []
    for sizes, engine in layouts:
        state = initialize_model_parallel(**sizes)
        model = _our_model(family, state, **engine)
        config = GenerationConfig(max_new_tokens=NEW)
        eager = generate(model, state, PROMPTS, config).token_ids
        results.append(generate(model, state, PROMPTS, config, compiled=True).token_ids == eager)
        destroy_model_parallel()
    return results


# Hang detection only. Each rank compiles its graphs while its peer waits in a collective (under PP,
# stage 1 waits in recv for all of stage 0's compilation, and stage 0 for stage 1's), so both the
# harness and the collective timeout (0.9 of it) must outlast compilation on a loaded machine: ~60 s
# in all when quiet, 242 s measured with a cold inductor cache at load average ~9 on 2 cores (past
# the former 180 s harness / 162 s collective default; pytest's 300 s is next).
COMPILED_LAYOUTS_TIMEOUT_S = 1500


@pytest.mark.slow      # a compilation per layout on each of 2 ranks, ~40 s on a quiet machine
@pytest.mark.timeout(COMPILED_LAYOUTS_TIMEOUT_S + 300)
def test_compiled_decoding_under_parallel_layouts():
    """Where layers communicate (TP, EP, PP), the compiled step breaks its graph around the
    collectives and the MoE dispatch (always eager): still the eager tokens."""
    # TP and EP in one layout (EP folded over the TP ranks: one compilation fewer), then PP.
    layouts = [(dict(tp=2, ep=2, etp=1), dict(dispatcher="alltoall", num_expert_slots=12)),
               (dict(pp=2), {})]
    results = run_on_ranks(_compiled_layouts_worker, 2, args=("qwen2_moe", layouts),
                           timeout_s=COMPILED_LAYOUTS_TIMEOUT_S)
    assert results == [[True] * 2] * 2


@pytest.mark.slow
def test_generation_under_parallel_layouts():
    with tempfile.TemporaryDirectory() as tmp:
        cases, expected = [], {}
        for family in SUPPORTED_FAMILIES:
            case, expected[family] = _expected(family, tmp)
            cases.append(case)
        load_file = os.path.join(tmp, "expert_load.json")
        results = run_on_ranks(_layouts_worker, 4, args=(cases, LAYOUTS, load_file))
        recorded = load_expert_load(load_file)

    checked = set()
    for rank, per_rank in enumerate(results):
        for name, family, mine, greedy, sampled, load, placements in per_rank:
            want = expected[family]
            what = f"{family} under {name}, rank {rank}"
            assert greedy == [want["greedy"][i] for i in mine], f"{what}: {greedy} != transformers"
            if sampled is not None:
                assert sampled == [want["sampled"][i] for i in mine], f"{what}: sampled tokens differ"
            assert load == want["load"], f"{what}: expert load {load} != single process {want['load']}"
            if LAYOUTS[name].from_checkpoint:
                assert placements == want["placements"], f"{what}: the saved placement was not used"
            checked.add((name, family))
    assert len(checked) == len(LAYOUTS) * len(SUPPORTED_FAMILIES)

    # The recorded file round-trips and feeds a balanced placement (balancedness reported).
    first = SUPPORTED_FAMILIES[0]
    assert {i: n.tolist() for i, n in recorded.items()} == {i: [float(c) for c in n]
                                                            for i, n in expected[first]["load"].items()}
    for layer_id, load in recorded.items():
        balanced = ExpertPlacement.balanced(load, 12, 4)
        default = ExpertPlacement.default(8, 12, 4)
        print(f"{first} layer {layer_id}: balancedness {balanced.balancedness(load):.3f} balanced, "
              f"{default.balancedness(load):.3f} default (EP 4, 12 slots)")
        assert balanced.balancedness(load) >= default.balancedness(load)


# ----------------------------------------------------------------------------------------------
# examples/generate.py
# ----------------------------------------------------------------------------------------------
def _run_script(args, nproc, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--nproc-per-node", str(nproc)]
    result = subprocess.run([*launcher, os.path.join(REPO, "examples", "generate.py"), *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_generate_script_help():
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", "generate.py"), "--help"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0
    for flag in ("--tp", "--pp", "--ep", "--etp", "--order", "--dispatcher", "--num-expert-slots", "--expert-backend",
                 "--data-parallel-attention", "--device", "--dtype", "--prompt", "--prompt-file", "--prompt-ids",
                 "--tokenizer", "--add-bos", "--max-new-tokens", "--stop-token-id", "--temperature", "--top-k",
                 "--top-p", "--seed", "--output-json", "--record-expert-load"):
        assert flag in out.stdout, flag


@pytest.mark.slow
def test_generate_script_on_converted_checkpoint(tmp_path, monkeypatch):
    """transformers model -> megamoe-convert import-hf (EP 2, 12 slots) -> examples/generate.py, one
    process (compiled decoding) and 2 ranks with data-parallel attention (uneven requests):
    transformers' generate() ids, decoded with the tokenizer the conversion kept; the recorded
    expert load feeds import-hf --expert-load (balanced placements)."""
    from tokenizers import Tokenizer as TokenizerFile
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from megamoe.checkpoint.format import read_manifest
    from megamoe.hf.import_hf import import_hf
    from megamoe.checkpoint.layout import ParallelLayout

    family = "qwen3_moe"
    hf, config = hf_model(family)
    hf_dir, checkpoint = tmp_path / "hf", tmp_path / "ckpt"
    hf.save_pretrained(hf_dir)
    tokenizer = TokenizerFile(WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    import_hf(hf_dir, checkpoint, ParallelLayout(ep=2), num_expert_slots=12)
    stop = _stop_token(family)[0]
    expected = _hf_generate(hf, PROMPTS, NEW, stop)
    args = [str(checkpoint), "--prompt", " ".join(f"t{i}" for i in PROMPTS[0]),
            *(arg for prompt in PROMPTS[1:] for arg in ("--prompt-ids", ",".join(map(str, prompt)))),
            "--max-new-tokens", str(NEW), "--stop-token-id", str(stop)]

    single = _run_script([*args, "--compile", "--output-json", "one.json"], 1, tmp_path)
    document = json.loads((tmp_path / "one.json").read_text())
    assert [r["ids"] for r in document["requests"]] == expected
    assert [r["prompt_ids"] for r in document["requests"]] == PROMPTS
    assert document["requests"][0]["text"] == " ".join(f"t{i}" for i in expected[0])
    assert document["timings"]["decode_tokens"] == sum(len(ids) - 1 for ids in expected)
    timings = document["timings"]
    assert 0 < timings["compile_seconds"] <= timings["decode_seconds"]   # a fresh process compiles
    # Decode tokens/s leave the compile time out (it is reported apart).
    assert timings["decode_seconds_excluding_compile"] == pytest.approx(
        timings["decode_seconds"] - timings["compile_seconds"])
    assert 0 < timings["decode_tokens_excluding_compile"] < timings["decode_tokens"]
    assert timings["decode_tokens_per_second"] == pytest.approx(
        timings["decode_tokens_excluding_compile"] / timings["decode_seconds_excluding_compile"])
    assert f"--- request 3 ({document['requests'][3]['finish_reason']}" in single.stdout

    _run_script([*args, "--ep", "2", "--dispatcher", "allgather", "--data-parallel-attention",
                 "--output-json", "two.json", "--record-expert-load", "load.json"], 2, tmp_path)
    document = json.loads((tmp_path / "two.json").read_text())
    assert [r["ids"] for r in document["requests"]] == expected
    assert document["layout"]["ep"] == 2 and document["layout"]["data_parallel_attention"]
    load = load_expert_load(tmp_path / "load.json")
    fed = sum(len(p) + len(ids) - 1 for p, ids in zip(PROMPTS, expected))
    assert set(load) == set(config.moe_layer_ids)
    assert all(int(n.sum()) == config.moe.router.top_k * fed for n in load.values())

    import_hf(hf_dir, tmp_path / "balanced", ParallelLayout(ep=2), num_expert_slots=12,
              expert_load=tmp_path / "load.json")
    saved = read_manifest(tmp_path / "balanced")["expert_placement"]
    assert saved == {str(i): ExpertPlacement.balanced(n, 12, 2).to_dict() for i, n in load.items()}

    # The Generation example of docs/generation.md runs as written, on this checkpoint.
    page = open(os.path.join(REPO, "docs/generation.md")).read()
    example = re.search(r"```python\n(.*?)```", page[page.index("# Generation"):], re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(example.replace('"path/to/checkpoint"', repr(str(checkpoint))), namespace)
    out = namespace["out"]
    assert len(out.token_ids) == 2 and all(len(ids) == 16 if reason == "length" else ids[-1] == 2
                                           for ids, reason in zip(out.token_ids, out.finish_reasons))
    assert set(load_expert_load(tmp_path / "expert_load.json")) == set(config.moe_layer_ids)


def test_decode_tokens_per_second_leaves_the_compiling_steps_out():
    from megamoe.inference.generation import GenerationOutput
    out = GenerationOutput(token_ids=[[1, 2, 3, 4, 5], [6, 7, 8]], finish_reasons=["length"] * 2, prompt_tokens=4,
                           prefill_seconds=0.5, decode_seconds=12.0, decode_steps=4, compile_seconds=10.0,
                           compile_tokens=2)
    assert out.decode_tokens == 6
    assert out.decode_tokens_per_second == pytest.approx(4 / 2.0)
