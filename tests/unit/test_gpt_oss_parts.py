"""gpt-oss's building blocks on their own (the whole family is checked against transformers in
tests/unit/test_hf_families.py, test_inference.py and test_convert.py): experts with biases and the clamped
SwiGLU on every backend that takes them and under expert TP, and attention sinks through the packed-document
and KV-cache paths."""

import math

import pytest
import torch

from megamoe.moe.experts.clamped_swiglu import ClampedSwiGLU
from megamoe.moe.experts.fp8 import FP8Config
from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts
from megamoe.transformer.attention import Attention, AttentionConfig
from megamoe.transformer.rope import RopeConfig

H, F, SLOTS = 8, 6, 3
COUNTS = torch.tensor([2, 0, 3])


def _experts(backend="torch", etp_size=1, etp_rank=0):
    experts = GroupedExperts(ExpertsConfig(SLOTS, H, F, activation="swiglu_clamped", backend=backend, bias=True,
                                           swiglu_limit=0.5, etp_size=etp_size, etp_rank=etp_rank),
                             dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for s in range(SLOTS):
        gate, up, down = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((F, H), (F, H), (H, F)))
        gate_bias, up_bias, down_bias = (torch.randn(n, generator=g, dtype=torch.float64) for n in (F, F, H))
        experts.load_expert_weights(s, gate, up, down, gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias)
    return experts


def _reference(experts, tokens):
    """HF's GptOssExperts per row, from the full per-slot weights."""
    rows, start = [], 0
    for s, n in enumerate(COUNTS.tolist()):
        w = experts.expert_weight_shards(s)
        x = tokens[start:start + n]
        gate, up = x @ w["gate"].T + w["gate_bias"], x @ w["up"].T + w["up_bias"]
        gate, up = gate.clamp(max=0.5), up.clamp(-0.5, 0.5)
        rows.append(((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ w["down"].T + w["down_bias"])
        start += n
    return torch.cat(rows)


def _run(experts, tokens):
    tokens = tokens.clone().requires_grad_()
    out = experts(tokens, COUNTS)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).cos()).sum().backward()
    return out, tokens.grad, {n: p.grad for n, p in experts.named_parameters()}


def test_biased_clamped_experts_match_the_reference_on_every_backend_and_under_etp():
    tokens = torch.randn(int(COUNTS.sum()), H, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    full = _experts("loop")
    expected = _reference(full, tokens)
    assert (tokens @ full.w_gate_up[0].T).abs().max() > 0.5, "the clamps must act"
    out_loop, dx_loop, grads_loop = _run(full, tokens)
    torch.testing.assert_close(out_loop, expected)
    out, dx, grads = _run(_experts("torch"), tokens)              # the fused autograd function
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(dx, dx_loop)
    for name, grad in grads_loop.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    with torch.no_grad():                                         # the inference path of the torch backend
        torch.testing.assert_close(_experts("torch")(tokens, COUNTS), expected)
    # ETP 2: the outputs sum to the full one (down bias added once); each rank's down-bias copy gets the
    # full gradient, so the copies stay equal; the gate/up bias gradients are the full one's halves.
    shards = [_run(_experts("torch", 2, r), tokens) for r in range(2)]
    torch.testing.assert_close(shards[0][0] + shards[1][0], expected)
    for r, (_, _, g) in enumerate(shards):
        torch.testing.assert_close(g["b_down"], grads_loop["b_down"])
        half = slice(r * F // 2, (r + 1) * F // 2)
        torch.testing.assert_close(g["b_gate_up"], torch.cat([grads_loop["b_gate_up"][:, :F][:, half],
                                                              grads_loop["b_gate_up"][:, F:][:, half]], dim=1))
    loop_shards = [_run(_experts("loop", 2, r), tokens) for r in range(2)]
    torch.testing.assert_close(loop_shards[0][0] + loop_shards[1][0], expected)
    torch.testing.assert_close(loop_shards[1][2]["b_down"], grads_loop["b_down"])
    # Compiled decoding's pair-by-pair path: the same expert outputs, weighted, the down bias once under ETP.
    slot_ids, weights = torch.tensor([[0, 2], [2, -1]]), torch.tensor([[0.25, 0.75], [1.0, 0.5]], dtype=torch.float64)
    pairs = tokens[:2]
    per_slot = [_reference(full, torch.cat([pairs[t:t + 1].expand(int(n), -1) for n in COUNTS]))
                for t in range(2)]                          # row s of per_slot[t]: token t through slot s
    firsts = torch.cumsum(COUNTS, 0) - COUNTS
    expected_pairs = torch.stack([0.25 * per_slot[0][firsts[0]] + 0.75 * per_slot[0][firsts[2]],
                                  per_slot[1][firsts[2]]])
    with torch.no_grad():
        torch.testing.assert_close(full.forward_per_pair(pairs, slot_ids, weights), expected_pairs)
        etp = [_experts("torch", 2, r).forward_per_pair(pairs, slot_ids, weights) for r in range(2)]
    torch.testing.assert_close(etp[0] + etp[1], expected_pairs)
    # Expert migration and checkpoints see the biases as part of the slot.
    assert [p is full.b_gate_up or p is full.b_down for p, _ in full.slot_parameters(1)] == [False, False, True, True]


def test_biased_experts_refuse_fp8_and_transformer_engine():
    with pytest.raises(ValueError, match="FP8 experts support neither expert biases"):
        ExpertsConfig(2, H, F, bias=True, backend="fp8_emulated", fp8=FP8Config())
    with pytest.raises(ValueError, match="FP8 experts support neither"):
        ExpertsConfig(2, H, F, activation="swiglu_clamped", backend="fp8_emulated", fp8=FP8Config())
    with pytest.raises(ValueError, match="'te' backend has no expert biases"):
        ExpertsConfig(2, H, F, bias=True, backend="te")
    with pytest.raises(ValueError, match="ClampedSwiGLU.limit must be > 0"):
        ExpertsConfig(2, H, F, activation="swiglu_clamped", swiglu_limit=0.0)
    glu_at_limit = 7 / (1 + math.exp(-1.702 * 7))           # gate clamped to 7 from above
    out = ClampedSwiGLU().forward(torch.tensor([[100.0, -100.0], [100.0, 100.0], [-100.0, 3.0]], dtype=torch.float64))
    torch.testing.assert_close(out[:, 0], torch.tensor([-6 * glu_at_limit, 8 * glu_at_limit,     # up clamped to -7 / 7
                                                        4 * -100 / (1 + math.exp(170.2))], dtype=torch.float64))


def _attention(window=None):
    torch.manual_seed(0)
    attention = Attention(AttentionConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                          rope=RopeConfig(dim=4), sinks=True, qkv_bias=True, sliding_window=window),
                          dtype=torch.float64)
    with torch.no_grad():
        attention.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 4.0]))
    return attention


def _sink_reference(attention, x):
    """softmax(cat(scores, sink))[..., :-1] @ V, written out (HF's eager gpt-oss attention)."""
    q, k, v = (layer(x).unflatten(-1, (-1, 4)).transpose(1, 2) for layer in (attention.q_proj, attention.k_proj,
                                                                             attention.v_proj))
    positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    cos, sin = attention.rotary(positions)
    q, k = attention.rotary.rotate(q, cos, sin), attention.rotary.rotate(k, cos, sin)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / 2.0
    i, j = torch.arange(x.shape[1])[:, None], torch.arange(x.shape[1])[None, :]
    hidden = (j > i) | ((i - j) >= (attention.config.sliding_window or x.shape[1] + 1))
    scores = scores.masked_fill(hidden, float("-inf"))
    sinks = attention.sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    return attention.o_proj((probs @ v).transpose(1, 2).flatten(2))


def test_attention_sinks_through_the_plain_packed_and_cached_paths():
    x = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for window in (None, 3):
        attention = _attention(window)
        positions = torch.arange(7).expand(1, -1)
        with torch.no_grad():
            expected = _sink_reference(attention, x)
            torch.testing.assert_close(attention(x, positions), expected)
            # Packed documents: two documents, each with its own positions, equal each run alone.
            documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
            packed = attention(x, torch.tensor([[0, 1, 2, 3, 0, 1, 2]]), document_ids=documents)
            torch.testing.assert_close(packed[:, :4], _sink_reference(attention, x[:, :4]))
            torch.testing.assert_close(packed[:, 4:], _sink_reference(attention, x[:, 4:]))
            # KV cache: a prefill of 4 then one token at a time give the full forward's rows.
            from megamoe.inference.kv_cache import StaticKVCache
            cache = StaticKVCache(7)
            rows = [attention(x[:, :4], positions[:, :4], cache)]
            rows += [attention(x[:, t:t + 1], positions[:, t:t + 1], cache) for t in range(4, 7)]
            torch.testing.assert_close(torch.cat(rows, dim=1), expected)
