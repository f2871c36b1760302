"""Transformer blocks against transformers' own modules (fp32, one rank): RMSNorm, RoPE frequencies
and layouts, GQA attention (Mixtral + sliding window, Qwen2-MoE qkv bias, Qwen3-MoE per-head q/k
norm, OLMoE full-width q/k norm + clip), MLA (DeepSeek-V2 without q LoRA + yarn, DeepSeek-V3 with q
LoRA, both rope layouts) and the dense MLP: outputs, input gradients and every weight gradient.
Then every block under TP=2 and TP=4 (replicated KV heads) against the single-rank block.

The HF-config -> block-config mapping of each family (``attention_config`` / ``mla_config`` /
``mlp_config``) is :mod:`megamoe.models.families`'s.
"""

import pytest
import torch

from megamoe.models.families import attention_config, mla_config, mlp_config
from megamoe.transformer import (MLP, Attention, AttentionConfig, MLAConfig, MLPConfig, MultiHeadLatentAttention,
                                 RMSNorm, RopeConfig, RotaryEmbedding, apply_rotary)
from tests.helpers.transformer_blocks import (B, H, POSITIONS, S, YARN_V2, _close, _data, _hf, _load_full, _randomize,
                                              hf_configs)


def _hf_mask(window=None):
    q_idx, kv_idx = torch.arange(S)[:, None], torch.arange(S)[None, :]
    masking = _hf().masking
    fn = masking.causal_mask_function if window is None else masking.sliding_window_causal_mask_function(window)
    allowed = fn(0, 0, q_idx, kv_idx)
    return torch.zeros(S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def _compare_with_hf(ours, run_ours, hf, run_hf, what):
    """Same input and output gradient through both; outputs, input and weight gradients must agree."""
    x_ours = _data(1, B, S, H).requires_grad_()
    x_hf = x_ours.detach().clone().requires_grad_()
    dy = _data(2, B, S, H) * 0.1            # keeps weight gradients O(1), so 1e-5 is ~10x fp32 rounding
    y_ours, y_hf = run_ours(x_ours), run_hf(x_hf)
    _close(y_ours, y_hf, f"{what} output")
    y_ours.backward(dy)
    y_hf.backward(dy)
    _close(x_ours.grad, x_hf.grad, f"{what} input grad")
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        _close(p.grad, hf_params[name].grad, f"{what} grad of {name}")


def _hf_attention(kind, cfg):
    cfg._attn_implementation = "eager"
    hf = _hf().attention[kind](cfg, layer_idx=0)
    _randomize(hf, seed=len(kind))
    rotary = _hf().rotary[kind](cfg)
    window = getattr(cfg, "sliding_window", None) if kind == "mixtral" else None
    mask = _hf_mask(window)

    def run(x):
        pos_emb = rotary(x, POSITIONS)
        if kind == "deepseek_v2":
            return hf(x, attention_mask=mask, position_embeddings=pos_emb)[0]
        return hf(x, position_embeddings=pos_emb, attention_mask=mask)[0]
    return hf, run


# ----------------------------------------------------------------------------------------------
# Single-rank tests against HF
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2"])
def test_attention_matches_hf(kind):
    cfg = hf_configs()[kind]
    hf, run_hf = _hf_attention(kind, cfg)
    ours = Attention(attention_config(cfg))
    _load_full(ours, dict(hf.named_parameters()))
    _compare_with_hf(ours, lambda x: ours(x, POSITIONS), hf, run_hf, kind)


def test_attention_config_mapping():
    configs = hf_configs()
    assert attention_config(configs["mixtral"]).sliding_window == 3
    qwen2 = attention_config(configs["qwen2_moe"])
    assert qwen2.qkv_bias and not qwen2.o_proj_bias and qwen2.sliding_window is None
    qwen3 = attention_config(configs["qwen3_moe"])
    assert qwen3.qk_norm == "per_head" and qwen3.head_dim == 12 and qwen3.o_proj_bias
    olmoe = attention_config(configs["olmoe"])
    assert olmoe.qk_norm == "full_width" and olmoe.clip_qkv == 2.5
    glm = attention_config(configs["glm4_moe"])
    assert (glm.rope.dim, glm.head_dim, glm.rope.rope_type, glm.qk_norm) == (6, 12, "yarn", "per_head")
    assert glm.qkv_bias and not glm.o_proj_bias
    minimax = attention_config(configs["minimax_m2"])
    assert (minimax.rope.dim, minimax.head_dim, minimax.qk_norm, minimax.qkv_bias) == (4, 8, "full_width", False)
    # Qwen2-MoE with use_sliding_window: HF marks layers 0, 2, 4, ... below max_window_layers as sliding.
    sliding = _hf().transformers.Qwen2MoeConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                                                num_hidden_layers=2, use_sliding_window=True, sliding_window=5,
                                                max_window_layers=2)
    assert [attention_config(sliding, i).sliding_window for i in range(2)] == [5, None]


@pytest.mark.parametrize("kind,rope_interleave", [("deepseek_v2", None), ("deepseek_v3", True),
                                                  ("deepseek_v3", False)])
def test_mla_matches_hf(kind, rope_interleave):
    cfg = hf_configs()[kind]
    if rope_interleave is not None:
        cfg.rope_interleave = rope_interleave
    hf, run_hf = _hf_attention(kind, cfg)
    config = mla_config(cfg)
    assert config.rope.softmax_scale_factor() != 1.0          # the yarn mscale correction is exercised
    ours = MultiHeadLatentAttention(config)
    _load_full(ours, dict(hf.named_parameters()))
    assert abs(config.softmax_scale - hf.scaling) < 1e-12
    _compare_with_hf(ours, lambda x: ours(x, POSITIONS), hf, run_hf, f"{kind} interleave={rope_interleave}")


@pytest.mark.parametrize("kind", ["qwen2_moe", "deepseek_v2"])
def test_mlp_matches_hf(kind):
    cfg = hf_configs()[kind]
    hf = _hf().mlp[kind](cfg)
    _randomize(hf, seed=3)
    ours = MLP(mlp_config(cfg))
    _load_full(ours, dict(hf.named_parameters()))
    _compare_with_hf(ours, ours, hf, hf, f"{kind} mlp")


def test_plain_mlp():
    """Without a gate: down(act(up(x))), checked against the formula (no supported family uses it)."""
    mlp = MLP(MLPConfig(H, 24, activation="gelu_pytorch_tanh", gated=False, bias=True))
    assert mlp.gate_proj is None
    with torch.no_grad():
        mlp.up_proj.bias.normal_()
    x = _data(1, B, S, H)
    up = torch.nn.functional.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
    expected = torch.nn.functional.linear(torch.nn.functional.gelu(up, approximate="tanh"), mlp.down_proj.weight,
                                          mlp.down_proj.bias)
    _close(mlp(x), expected, "plain mlp")


def test_rms_norm_matches_hf():
    hf = _hf().mixtral.MixtralRMSNorm(H, eps=1e-5)
    _randomize(hf, seed=4)
    ours = RMSNorm(H, eps=1e-5)
    _load_full(ours, dict(hf.named_parameters()))
    _compare_with_hf(ours, ours, hf, hf, "rms norm")
    x16 = _data(5, B, S, H).bfloat16()
    with torch.no_grad():                     # fp32 compute, cast back before the weight: bitwise as HF
        assert torch.equal(ours.bfloat16()(x16), hf.bfloat16()(x16))
    ours.reset_parameters()
    assert torch.equal(ours.weight, torch.ones(H, dtype=ours.weight.dtype))


ROPE_PARAMETERS = [
    {"rope_type": "default", "rope_theta": 5000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 1e4},                       # positions exceed 16
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 1e4},
    {**YARN_V2, "original_max_position_embeddings": 8},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "attention_factor": 0.8,
     "beta_fast": 16, "beta_slow": 2, "truncate": False, "rope_theta": 1e4},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8, "rope_theta": 5e5},
]


@pytest.mark.parametrize("params", ROPE_PARAMETERS, ids=lambda p: p["rope_type"])
def test_rope_frequencies_match_hf(params):
    dim = 16
    cfg = _hf().transformers.MixtralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=dim,
                        max_position_embeddings=16, rope_parameters=dict(params))
    config = RopeConfig.from_hf(cfg.rope_parameters, dim=dim, max_position_embeddings=16)
    if params["rope_type"] != "default":
        inv_freq, scaling = _hf().rope_utils.ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg)
        _close(config.inv_freq(), inv_freq, "inv_freq", atol=0)
        assert config.attention_scaling() == pytest.approx(scaling, abs=1e-12)
    cos, sin = _hf().mixtral.MixtralRotaryEmbedding(cfg)(torch.zeros(1), POSITIONS)
    ours_cos, ours_sin = RotaryEmbedding(config)(POSITIONS)
    _close(ours_cos, cos[..., : dim // 2], "cos", atol=1e-6)
    _close(ours_sin, sin[..., : dim // 2], "sin", atol=1e-6)
    _close(cos[..., dim // 2:], cos[..., : dim // 2], "HF cos is cat(freqs, freqs)", atol=0)


def test_rope_layouts_match_hf():
    dim = 8
    cfg = hf_configs()["deepseek_v2"]
    config = mla_config(cfg).rope
    q, k = _data(6, B, 3, S, dim), _data(7, B, 1, S, dim)
    cos, sin = RotaryEmbedding(config)(POSITIONS)
    # DeepSeek-V2: complex multiplication of interleaved pairs; same angles, pairs stay in place.
    hf_v2, hf_v3 = _hf().v2, _hf().v3
    freqs_cis = hf_v2.DeepseekV2RotaryEmbedding(cfg)(q, POSITIONS)
    _close(cos, freqs_cis.real, "V2 cos", atol=1e-6)
    _close(sin, freqs_cis.imag, "V2 sin", atol=1e-6)
    q_cos, q_sin = _data(8, B, S, dim // 2), _data(9, B, S, dim // 2)     # arbitrary angles test the algebra
    hf_q, hf_k = hf_v2.apply_rotary_emb(q[..., :4], k[..., :4], torch.complex(q_cos[..., :2], q_sin[..., :2]))
    _close(apply_rotary(q[..., :4], q_cos[..., :2], q_sin[..., :2], "interleaved"), hf_q, "V2 q")
    _close(apply_rotary(k[..., :4], q_cos[..., :2], q_sin[..., :2], "interleaved"), hf_k, "V2 k")
    # DeepSeek-V3 (rope_interleave): the same rotation written de-interleaved.
    full_cos, full_sin = torch.cat([q_cos, q_cos], -1), torch.cat([q_sin, q_sin], -1)
    hf_q, hf_k = hf_v3.apply_rotary_pos_emb_interleave(q, k, full_cos, full_sin)
    deinterleave = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])
    _close(apply_rotary(q, q_cos, q_sin, "interleaved")[..., deinterleave], hf_q, "V3 interleave q")
    _close(apply_rotary(k, q_cos, q_sin, "interleaved")[..., deinterleave], hf_k, "V3 interleave k")
    # rotate_half (Llama family, V3 without rope_interleave).
    hf_q, hf_k = hf_v3.apply_rotary_pos_emb(q, k, full_cos, full_sin)
    _close(apply_rotary(q, q_cos, q_sin, "half"), hf_q, "rotate_half q")
    _close(apply_rotary(k, q_cos, q_sin, "half"), hf_k, "rotate_half k")


class _ConcatCache:
    """The simplest cache honouring the seam: append along the sequence dim (-2)."""

    def __init__(self):
        self.entries = None

    def update(self, a, b):
        self.entries = (a, b) if self.entries is None else tuple(
            torch.cat([old, new], dim=-2) for old, new in zip(self.entries, (a, b)))
        return self.entries


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_kv_cache_seam(kind):
    """Prefill 4 tokens, then decode 3 one at a time: same outputs as one full forward (the mask is
    aligned to the end of the keys, sliding window included)."""
    cfg = hf_configs()[kind]
    block = Attention(attention_config(cfg)) if kind == "mixtral" else MultiHeadLatentAttention(mla_config(cfg))
    x = _data(10, B, S, H)
    with torch.no_grad():
        full = block(x, POSITIONS)
        cache = _ConcatCache()
        steps = [block(x[:, :4], POSITIONS[:, :4], kv_cache=cache)]
        steps += [block(x[:, t:t + 1], POSITIONS[:, t:t + 1], kv_cache=cache) for t in range(4, S)]
    _close(torch.cat(steps, dim=1), full, f"{kind} cached decode")


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_static_shape_kv_cache_decode(kind):
    """The compiled-decoding form of the seam: after an appending prefill, each decode step writes at
    the cache's ``write_index``, the cache returns its whole (longer, zero-filled) buffer and the
    attention keeps the positions its mask spans (a padding column hidden): same outputs as appending.
    Without a mask such a cache is refused."""
    from megamoe.inference.kv_cache import StaticKVCache
    cfg = hf_configs()[kind]
    block = Attention(attention_config(cfg)) if kind == "mixtral" else MultiHeadLatentAttention(mla_config(cfg))
    x = _data(11, B, S, H)
    width = S + 5                                               # room the decode never fills
    mask = torch.zeros(B, width, dtype=torch.bool)
    mask[:, :S] = True
    mask[0, 1] = False                                          # a padding position of row 0
    with torch.no_grad():
        appending, static = StaticKVCache(width), StaticKVCache(width)
        block(x[:, :4], POSITIONS[:, :4], appending, mask[:, :4])
        expected = [block(x[:, t:t + 1], POSITIONS[:, t:t + 1], appending, mask[:, :t + 1]) for t in range(4, S)]
        block(x[:, :4], POSITIONS[:, :4], static, mask[:, :4])
        static.write_index = torch.zeros(1, dtype=torch.int64)
        got = []
        for t in range(4, S):
            static.write_index.fill_(t)
            got.append(block(x[:, t:t + 1], POSITIONS[:, t:t + 1], static, mask[:, :t + 1]))
            assert static.query_positions.tolist() == [t]
        with pytest.raises(ValueError, match="needs the attention_mask"):
            block(x[:, -1:], POSITIONS[:, -1:], static)
    assert all(b.shape[-2] == width for b in static.buffers)
    assert all(torch.equal(b[..., S:, :], torch.zeros_like(b[..., S:, :])) for b in static.buffers)
    _close(torch.cat(got, dim=1), torch.cat(expected, dim=1), f"{kind} static-shape decode")


def test_configs_validate_themselves():
    rope = RopeConfig(dim=8)
    with pytest.raises(ValueError, match="num_attention_heads"):
        AttentionConfig(hidden_size=H, num_attention_heads=6, num_key_value_heads=4, head_dim=8, rope=rope)
    with pytest.raises(ValueError, match="rope.dim"):
        AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=4, rope=rope)
    with pytest.raises(ValueError, match="qk_norm"):
        AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope=rope,
                        qk_norm="olmo")
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope=rope,
                        sliding_window=0)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        MLAConfig(hidden_size=H, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8, rope=rope)
    with pytest.raises(ValueError, match="rope_type"):
        RopeConfig.from_hf({"rope_type": "longrope"}, dim=8, max_position_embeddings=16)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RopeConfig.from_hf({"rope_type": "default", "partial_rotary_factor": 0.5}, dim=8, max_position_embeddings=16)
    partial = dict(dim=12, max_position_embeddings=16, partial_rotary=True)
    assert RopeConfig.from_hf({"partial_rotary_factor": 0.5}, **partial).dim == 6
    assert RopeConfig.from_hf({}, **partial).dim == 12
    with pytest.raises(ValueError, match="rotates 3 of the 12 head dims"):
        RopeConfig.from_hf({"partial_rotary_factor": 0.25}, **partial)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\], got 1.5"):
        RopeConfig.from_hf({"partial_rotary_factor": 1.5}, **partial)
    with pytest.raises(ValueError, match="8 rotary dims exceed the 6 features"):
        apply_rotary(torch.zeros(1, 1, 2, 6), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), "half")
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeConfig(dim=8, rope_type="yarn", factor=4.0)
    with pytest.raises(ValueError, match="RopeConfig.dim"):
        RopeConfig(dim=7)
    with pytest.raises(ValueError, match="MLPConfig.activation"):
        MLPConfig(H, 16, activation="swish")
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(H, eps=0.0)
