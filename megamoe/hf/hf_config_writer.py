"""A HuggingFace config.json for a model config that has none (trained from scratch from megamoe fields).

The inverse of :func:`megamoe.models.families.config_from_hf` for the families listed in
:data:`WRITABLE_FAMILIES`: the fields are set on the family's transformers config class and written as
``save_pretrained`` writes them (the differences from the class defaults). The result is then mapped back
and must give the model config again (:func:`~megamoe.hf.export_hf.check_hf_config_describes`):
a megamoe config the family cannot express (another router score function, layers whose MoE-ness the
family's rule cannot state, ...) is refused naming the differing fields, never exported as another
model. A rope without ``max_position_embeddings`` is written with :data:`DEFAULT_MAX_POSITIONS`.
"""

from __future__ import annotations

import dataclasses
import json

from megamoe.checkpoint.errors import ConversionError
from megamoe.hf.export_hf import check_hf_config_describes
from megamoe.hf.import_hf import hf_config_object
from megamoe.models import GPTMoEConfig
from megamoe.transformer.rope import RopeConfig

__all__ = ["WRITABLE_FAMILIES", "DEFAULT_MAX_POSITIONS", "hf_config_for"]

DEFAULT_MAX_POSITIONS = 4096
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
WRITABLE_FAMILIES = tuple(_ARCHITECTURES)
# rope_parameters fields RopeConfig keeps, by the rope types that read them (see RopeConfig.from_hf).
_ROPE_FIELDS = {"linear": ("factor",), "dynamic": ("factor",),
                "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                         "mscale", "mscale_all_dim", "truncate"),
                "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}


def _rope_parameters(rope: RopeConfig) -> dict:
    params = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    for name in _ROPE_FIELDS.get(rope.rope_type, ()):
        if getattr(rope, name) is not None:
            params[name] = getattr(rope, name)
    return params


def _common(config: GPTMoEConfig, rope: RopeConfig) -> dict:
    moe, dense = config.moe, config.dense_mlp
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                num_attention_heads=config.attention.num_attention_heads, rms_norm_eps=config.norm_eps,
                max_position_embeddings=rope.max_position_embeddings, rope_parameters=_rope_parameters(rope),
                tie_word_embeddings=config.tie_word_embeddings, initializer_range=config.init_std, hidden_act="silu",
                intermediate_size=dense.intermediate_size if dense is not None else moe.ffn_hidden_size,
                moe_intermediate_size=moe.ffn_hidden_size, num_experts_per_tok=moe.router.top_k,
                norm_topk_prob=moe.router.norm_topk_prob, output_router_logits=False)


def _qwen3_moe(config: GPTMoEConfig, rope: RopeConfig) -> dict:
    attention, router = config.attention, config.moe.router
    return dict(_common(config, rope), num_key_value_heads=attention.num_key_value_heads,
                head_dim=attention.head_dim, attention_bias=attention.qkv_bias,
                use_sliding_window=attention.sliding_window is not None, sliding_window=attention.sliding_window,
                num_experts=router.num_experts, router_aux_loss_coef=router.aux_loss_coeff / router.top_k,
                decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(config.num_layers) if not config.is_moe_layer(i)])


def _deepseek_v3(config: GPTMoEConfig, rope: RopeConfig) -> dict:
    attention, moe = config.attention, config.moe
    router, shared = moe.router, moe.shared_experts
    dense_layers = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    mtp_dense = [i for i in config.mtp_layer_ids if not config.is_moe_layer(i)]
    if mtp_dense and len(dense_layers) < config.num_layers:
        raise ConversionError(f"MTP layers {mtp_dense} are dense after MoE decoder layers: DeepSeek-V3's rule "
                              "(layer i is MoE iff i >= first_k_dense_replace) cannot express it")
    fields = dict(_common(config, rope), num_key_value_heads=attention.num_attention_heads,
                  q_lora_rank=attention.q_lora_rank, kv_lora_rank=attention.kv_lora_rank,
                  qk_nope_head_dim=attention.qk_nope_head_dim, qk_rope_head_dim=attention.qk_rope_head_dim,
                  v_head_dim=attention.v_head_dim, attention_bias=attention.attention_bias,
                  rope_interleave=rope.layout == "interleaved", n_routed_experts=router.num_experts,
                  n_shared_experts=0 if shared is None else max(1, shared.ffn_hidden_size // moe.ffn_hidden_size),
                  first_k_dense_replace=len(dense_layers), n_group=router.n_group, topk_group=router.topk_group,
                  routed_scaling_factor=router.routed_scaling_factor)
    if router.seq_aux_loss_coeff:
        fields.update(aux_loss_alpha=router.seq_aux_loss_coeff, seq_aux=True)
    return fields


_WRITERS = {"qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


def hf_config_for(config: GPTMoEConfig, where: str) -> dict:
    """The config.json dict (``model_type`` included) describing ``config``; ConversionError naming
    ``where`` (e.g. the model config file) when its family has no writer or cannot express it."""
    if config.family not in _WRITERS:
        raise ConversionError(f"{where}: writing an HF config.json for family {config.family!r} is not supported "
                              f"(supported: {', '.join(WRITABLE_FAMILIES)}); give an HF config.json instead")
    if config.moe is None:
        raise ConversionError(f"{where}: the model has no MoE layers; an HF {config.family} config.json needs some")
    rope = config.attention.rope
    if rope.max_position_embeddings is None:
        rope = dataclasses.replace(rope, max_position_embeddings=DEFAULT_MAX_POSITIONS)
        config = dataclasses.replace(config, attention=dataclasses.replace(config.attention, rope=rope))
    fields = dict(_WRITERS[config.family](config, rope), model_type=config.family)
    written = hf_config_object(fields, where)
    written.architectures = [_ARCHITECTURES[config.family]]
    hf_config = json.loads(written.to_json_string(use_diff=True))
    hf_config.setdefault("model_type", config.family)
    if config.family == "deepseek_v3":     # explicit: transformers' default (1) is left out by use_diff
        hf_config["num_nextn_predict_layers"] = config.mtp_num_layers
    check_hf_config_describes(hf_config, config, f"{where}: the written {config.family} config.json",
                              "this model: the family cannot express it")
    return hf_config
