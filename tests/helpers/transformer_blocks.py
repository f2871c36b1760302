"""Shared by tests/unit/test_transformer_blocks.py and tests/multirank/test_transformer_blocks.py: the builders and
constants of the transformer blocks tests."""

import functools
from types import SimpleNamespace

import torch

from megamoe.sharding import get_shard_spec


@functools.cache
def _hf():
    """transformers, imported on first use: the spawned TP ranks compare our blocks with each other
    and skip this import (seconds per rank)."""
    import transformers
    from transformers import masking_utils, modeling_rope_utils
    from transformers.models.deepseek_v2 import modeling_deepseek_v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.glm4_moe import modeling_glm4_moe
    from transformers.models.minimax_m2 import modeling_minimax_m2
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.olmoe import modeling_olmoe
    from transformers.models.qwen2_moe import modeling_qwen2_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    return SimpleNamespace(
        transformers=transformers, masking=masking_utils, rope_utils=modeling_rope_utils,
        mixtral=modeling_mixtral, v2=modeling_deepseek_v2, v3=modeling_deepseek_v3,
        attention={"mixtral": modeling_mixtral.MixtralAttention, "qwen2_moe": modeling_qwen2_moe.Qwen2MoeAttention,
                   "qwen3_moe": modeling_qwen3_moe.Qwen3MoeAttention, "olmoe": modeling_olmoe.OlmoeAttention,
                   "deepseek_v2": modeling_deepseek_v2.DeepseekV2Attention,
                   "deepseek_v3": modeling_deepseek_v3.DeepseekV3Attention,
                   "glm4_moe": modeling_glm4_moe.Glm4MoeAttention,
                   "minimax_m2": modeling_minimax_m2.MiniMaxM2Attention},
        rotary={"mixtral": modeling_mixtral.MixtralRotaryEmbedding,
                "qwen2_moe": modeling_qwen2_moe.Qwen2MoeRotaryEmbedding,
                "qwen3_moe": modeling_qwen3_moe.Qwen3MoeRotaryEmbedding,
                "olmoe": modeling_olmoe.OlmoeRotaryEmbedding,
                "deepseek_v2": modeling_deepseek_v2.DeepseekV2RotaryEmbedding,
                "deepseek_v3": modeling_deepseek_v3.DeepseekV3RotaryEmbedding,
                "glm4_moe": modeling_glm4_moe.Glm4MoeRotaryEmbedding,
                "minimax_m2": modeling_minimax_m2.MiniMaxM2RotaryEmbedding},
        mlp={"qwen2_moe": modeling_qwen2_moe.Qwen2MoeMLP, "deepseek_v2": modeling_deepseek_v2.DeepseekV2MLP})


B, S, H = 2, 7, 32
ATOL = 1e-5
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [5, 9, 10, 11, 20, 21, 40]])   # [B, S], not just arange


def _close(a, b, what, atol=ATOL):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.allclose(a, b, atol=atol, rtol=0), f"{what}: max diff {(a - b).abs().max().item():.3e}"


def _data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# Tiny HF configs
# ----------------------------------------------------------------------------------------------
YARN_V2 = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.707,
               mscale_all_dim=0.707, beta_fast=32, beta_slow=1, rope_theta=10000.0)
YARN_V3 = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=1.0,
               beta_fast=32, beta_slow=1, rope_theta=10000.0)


def hf_configs():
    t = _hf().transformers
    common = dict(hidden_size=H, num_hidden_layers=1, max_position_embeddings=64, rms_norm_eps=1e-5)
    return {
        "mixtral": t.MixtralConfig(**common, num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
        "qwen2_moe": t.Qwen2MoeConfig(**common, num_attention_heads=4, num_key_value_heads=2, qkv_bias=True,
                                    intermediate_size=24,
                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
        "qwen3_moe": t.Qwen3MoeConfig(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                    attention_bias=True,
                                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                     "original_max_position_embeddings": 16}),
        "olmoe": t.OlmoeConfig(**common, num_attention_heads=4, num_key_value_heads=2, clip_qkv=2.5,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        "deepseek_v2": t.DeepseekV2Config(**common, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16,
                                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, intermediate_size=24,
                                        mlp_bias=True, rope_parameters=dict(YARN_V2)),
        "deepseek_v3": t.DeepseekV3Config(**common, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12,
                                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                          attention_bias=True, rope_parameters=dict(YARN_V3)),
        # partial rotary: yarn over the first 6 of 12 head dims; q/k/v biases; per-head q/k norm
        "glm4_moe": t.Glm4MoeConfig(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                    attention_bias=True, use_qk_norm=True,
                                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                     "original_max_position_embeddings": 16,
                                                     "partial_rotary_factor": 0.5}),
        # rotary_dim 4 of 8; q/k norms across heads
        "minimax_m2": t.MiniMaxM2Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        rotary_dim=4, bos_token_id=None, eos_token_id=None),
    }


# ----------------------------------------------------------------------------------------------
# Comparison machinery
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def _randomize(module, seed):
    """Every parameter of an HF module to random values (norm weights around one)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=g) * 0.2
        p.copy_(1.0 + noise if "norm" in name else noise)


@torch.no_grad()
def _load_full(block, full_params: dict):
    """Copy each parameter's shard (per its ShardSpec) out of full logical tensors keyed by HF name."""
    assert set(dict(block.named_parameters())) == set(full_params), "parameter names differ from HF's"
    for name, p in block.named_parameters():
        p.copy_(get_shard_spec(p).slice_of(full_params[name]))
