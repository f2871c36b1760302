"""Tiny random HF models of every family (E=8, K=2), built once per process, and the inputs and logits that
compare our model with them. Shared by tests of both tiers."""

import functools

import torch
import torch.distributed as dist

from megamoe.models.families import config_from_hf

V, H, S = 64, 32, 9
ATOL = 1e-4
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=0.707,
            beta_fast=32, beta_slow=1, rope_theta=10000.0)
GPT_OSS_YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=16, rope_theta=150000.0)


@functools.cache
def lazy_transformers():
    """Imported on first use: the spawned ranks only run our model (transformers costs seconds each)."""
    import transformers
    return transformers


def hf_config(family):
    """A tiny config per family exercising its particular features (E=8, K=2)."""
    t = lazy_transformers()
    common = dict(vocab_size=V, hidden_size=H, num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5,
                  num_experts_per_tok=2)
    mla = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
               intermediate_size=24, moe_intermediate_size=16, n_routed_experts=8, first_k_dense_replace=1,
               num_hidden_layers=3, n_group=4, topk_group=2, rope_parameters=dict(YARN))
    configs = {
        "mixtral": lambda: t.MixtralConfig(**common, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=16,
                                           num_local_experts=8, sliding_window=5),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**common, num_key_value_heads=2, num_hidden_layers=3, mlp_only_layers=[1],
                                              intermediate_size=24, moe_intermediate_size=16,
                                              shared_expert_intermediate_size=20, num_experts=8),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=12, num_hidden_layers=3,
                                              decoder_sparse_step=2, attention_bias=True, norm_topk_prob=True,
                                              intermediate_size=24, moe_intermediate_size=16, num_experts=8,
                                              tie_word_embeddings=True),
        "olmoe": lambda: t.OlmoeConfig(**common, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=16,
                                       num_experts=8, clip_qkv=3.0, eos_token_id=None),
        "deepseek_v2": lambda: t.DeepseekV2Config(**common, **mla, q_lora_rank=None, n_shared_experts=2,
                                                  topk_method="group_limited_greedy", routed_scaling_factor=2.0),
        "deepseek_v3": lambda: t.DeepseekV3Config(**common, **mla, q_lora_rank=12, n_shared_experts=1,
                                                  routed_scaling_factor=2.5),
        # head_dim * heads != hidden; partial rotary 0.5 (rotates 6 of 12 dims); per-head qk norm; q/k/v bias
        "glm4_moe": lambda: t.Glm4MoeConfig(**common, num_key_value_heads=2, head_dim=12, num_hidden_layers=3,
                                            first_k_dense_replace=1, intermediate_size=24, moe_intermediate_size=16,
                                            n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
                                            routed_scaling_factor=1.5, use_qk_norm=True, attention_bias=True,
                                            num_nextn_predict_layers=0, eos_token_id=None),
        # rotary_dim 8 of head_dim 12; one KV head (replicated under TP 2) with the across-heads k norm
        "minimax_m2": lambda: t.MiniMaxM2Config(**common, num_key_value_heads=1, head_dim=12, rotary_dim=8,
                                                num_hidden_layers=2, intermediate_size=16, num_local_experts=8,
                                                bos_token_id=None, eos_token_id=None),
        # Sliding / full / sliding layers (window 4 < S), yarn without truncation as released, a swiglu_limit
        # the N(0, 0.2^2) weights cross (the clamps act); F = 32 so that MXFP4 (32-blocks) can store it.
        "gpt_oss": lambda: t.GptOssConfig(**common, num_key_value_heads=2, head_dim=8, num_hidden_layers=3,
                                          intermediate_size=32, num_local_experts=8, sliding_window=4,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                          swiglu_limit=1.0, rope_parameters=dict(GPT_OSS_YARN)),
    }
    return configs[family]()


@functools.cache
def hf_model(family):
    """(HF model with random weights, our config): norms around 1, everything else N(0, 0.2^2)."""
    t = lazy_transformers()
    cfg = hf_config(family)
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(len(family))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():      # includes DeepSeek-V3's e_score_correction_bias
            noise = torch.randn(tensor.shape, generator=g) * 0.2
            tensor.copy_(1.0 + noise if "norm" in name else noise)
    return model, config_from_hf(cfg, expert_backend="torch")


def _ids(batch, seed=1):
    return torch.randint(0, V, (batch, S), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _stage_logits(model, state, ids):
    """Run this rank's stage; the last stage returns the full logits (gathered over TP), others None."""
    if state.is_first_pp_stage:
        hidden, _ = model(ids)
    else:
        hidden = torch.empty(ids.shape[0], S, H)
        dist.recv(hidden, src=state.pp_prev_rank)
        hidden, _ = model(hidden)
    if not state.is_last_pp_stage:
        dist.send(hidden.contiguous(), dst=state.pp_next_rank)
        return None
    if state.tp.size == 1:
        return hidden
    shards = [torch.empty_like(hidden) for _ in range(state.tp.size)]
    dist.all_gather(shards, hidden.contiguous(), group=state.tp.group)
    return torch.cat(shards, dim=-1)
