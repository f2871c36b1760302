"""Generation with a KV cache (megamoe.inference).

The in-process cases; those that spawn ranks or run scripts end to end are in tests/multirank/test_inference.py."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from megamoe.inference.expert_load import reset_expert_load
from megamoe.inference.generation import GenerationConfig, generate, left_padded_batch, max_sequence_length
from megamoe.inference.generation_memory import estimate_generation_memory
from megamoe.inference.kv_cache import StaticKVCache
from megamoe.inference.sampling import SamplingConfig, request_generator, sample_next_tokens
from megamoe.models.families import SUPPORTED_FAMILIES
from megamoe.transformer import MultiHeadLatentAttention
from megamoe.transformer.mla import MLAConfig
from megamoe.transformer.rope import RopeConfig
from tests.helpers.hf_models import V, hf_model  # tiny random HF models of every family (E=8, K=2)
from tests.helpers.inference import NEW, PROMPTS, REPO, SAMPLING, SOLO, _hf_generate, _our_model, _stop_token


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


@pytest.mark.slow      # one torch.compile, ~20 s
def test_compiled_decoding_matches_eager():
    """generate(compiled=True): the same tokens, stop reasons and expert load as eager decoding, for a
    left-padded batch with a row that stops early (then runs on as padding), with replicated expert
    slots (MLA, shared experts, group-limited routing, a dense first layer: DeepSeek-V3); the step is
    one graph, and later calls with another cache length or batch size reuse it; the time spent
    compiling is reported. (Qwen2-MoE's gated shared expert compiles in one graph per pipeline stage in
    tests/multirank/test_inference.py, with its tokens under TP, EP and PP.)"""
    import torch._dynamo

    family = "deepseek_v3"

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


def test_generate_script_help():
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", "generate.py"), "--help"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0
    for flag in ("--tp", "--pp", "--ep", "--etp", "--order", "--dispatcher", "--num-expert-slots", "--expert-backend",
                 "--data-parallel-attention", "--device", "--dtype", "--prompt", "--prompt-file", "--prompt-ids",
                 "--tokenizer", "--add-bos", "--max-new-tokens", "--stop-token-id", "--temperature", "--top-k",
                 "--top-p", "--seed", "--output-json", "--record-expert-load"):
        assert flag in out.stdout, flag


def test_decode_tokens_per_second_leaves_the_compiling_steps_out():
    from megamoe.inference.generation import GenerationOutput
    out = GenerationOutput(token_ids=[[1, 2, 3, 4, 5], [6, 7, 8]], finish_reasons=["length"] * 2, prompt_tokens=4,
                           prefill_seconds=0.5, decode_seconds=12.0, decode_steps=4, compile_seconds=10.0,
                           compile_tokens=2)
    assert out.decode_tokens == 6
    assert out.decode_tokens_per_second == pytest.approx(4 / 2.0)
