"""HuggingFace config -> :class:`GPTMoEConfig` for the supported model families.

Checked against transformers 5.24's modeling code (HF config names in quotes):

- attention: GQA for mixtral, qwen2_moe, qwen3_moe, olmoe, glm4_moe, minimax_m2; MLA for deepseek_v2 /
  deepseek_v3 (interleaved rope for V2, and for V3 when "rope_interleave"). q/k norm: per head (qwen3_moe;
  glm4_moe when "use_qk_norm"), across heads (olmoe, minimax_m2, always). Biases: q/k/v from "qkv_bias"
  (qwen2_moe) or "attention_bias" (glm4_moe); q/k/v and o from "attention_bias" (qwen3_moe, olmoe).
  Partial rotary (glm4_moe, minimax_m2): the first ``int(head_dim * "partial_rotary_factor")`` features
  of each head rotate in the ``half`` layout (GLM's default factor is 0.5; MiniMax-M2's config derives it
  from "rotary_dim"); the other families refuse a factor other than 1. Sliding window:
  "sliding_window" on every layer (mixtral; qwen3_moe, whose config clears it unless
  "use_sliding_window"); qwen2_moe marks layers in "layer_types" (as gpt_oss does): mixed layers give
  ``GPTMoEConfig.sliding_window_layer_ids``.
- gpt_oss: GQA with q/k/v/o biases ("attention_bias"), attention sinks (``AttentionConfig.sinks``), yarn
  rope, sliding layers by "layer_types"; every layer MoE, "intermediate_size" per expert, experts with
  biases and the clamped SwiGLU ("swiglu_alpha", "swiglu_limit"; activation ``swiglu_clamped``), a router
  with bias and a softmax over the top-k logits (= renormalised softmax: ``norm_topk_prob``).
- which layers are MoE: every layer (mixtral, olmoe, minimax_m2); qwen2_moe / qwen3_moe: layer ``i``
  unless ``i in "mlp_only_layers"`` or ``(i + 1) % "decoder_sparse_step" != 0`` (none when
  "num_experts" is 0); deepseek, glm4_moe: ``i >= "first_k_dense_replace"`` (transformers ignores
  DeepSeek's "moe_layer_freq"; a value other than 1 is refused rather than silently reinterpreted).
- expert FFN size: "intermediate_size" (mixtral, olmoe, minimax_m2), "moe_intermediate_size" (qwen,
  deepseek, glm4_moe); dense layers use "intermediate_size".
- shared experts: qwen2_moe: "shared_expert_intermediate_size" with a sigmoid gate; deepseek:
  "n_shared_experts" * "moe_intermediate_size", no gate (glm4_moe likewise); minimax_m2 has none.
- router: see :mod:`megamoe.moe.router`. The balancing loss HF adds when "output_router_logits"
  (mixtral, qwen, olmoe) is reproduced with ``aux_loss_coeff = "router_aux_loss_coef" * top_k``.

Load balancing (``config_from_hf(..., for_training=...)``). HF configs ship with "output_router_logits"
False, so HF's forward adds no balancing loss; fine-tuning without one lets the routing collapse. By
default (``for_training=True``) the config therefore carries the family's balancing for training:

- mixtral, qwen2_moe, qwen3_moe, olmoe: ``aux_loss_coeff = "router_aux_loss_coef" * top_k`` whatever
  "output_router_logits" says;
- minimax_m2: the same coefficient, plus its expert bias (``use_expert_bias``: it routes by sigmoid score +
  "e_score_correction_bias", like DeepSeek-V3). HF computes its balancing loss from a softmax over the
  router logits, which its routing never uses; here the loss is the switch loss of the normalised
  sigmoid scores the router does use (as for DeepSeek-V3), so its value differs from HF's;
- deepseek_v2: DeepSeek's sequence-wise balance loss, ``seq_aux_loss_coeff = "aux_loss_alpha"``
  ("seq_aux" False: the batch-wise ``aux_loss_coeff``), defaulting to DeepSeek's 0.001 when the config
  has no "aux_loss_alpha" (transformers' own config class drops it; checkpoints' config.json carry it);
- deepseek_v3 and glm4_moe (whose router is DeepSeek-V3's: GLM-4.5 trains with loss-free balance routing):
  the aux-loss-free expert bias (``use_expert_bias``, update rate 1e-3 as in the paper), plus the
  sequence-wise loss when the config carries "aux_loss_alpha".

``for_training=False`` gives what HF's forward computes (for comparing training losses with
transformers): the mixtral / qwen / olmoe (and, in its own form, minimax_m2) loss only when
"output_router_logits", no loss for DeepSeek or GLM (the expert bias stays: it is part of their
routing). Logits never depend on the choice.

Multi-token prediction layers ("num_nextn_predict_layers", stored as ``model.layers.{L}.*`` after the L
decoder layers): DeepSeek-V3's are built (``config_from_hf(..., mtp_num_layers=...)``,
:mod:`megamoe.models.mtp`) when the checkpoint holds them, and so are GLM-4.5's (the same module and key
layout over GQA attention; transformers skips both).
"""

from __future__ import annotations

import logging

from megamoe.models.config import GPTMoEConfig
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.moe.token_dispatcher import DEFAULT_DISPATCHER
from megamoe.transformer.attention import AttentionConfig
from megamoe.transformer.mla import MLAConfig
from megamoe.transformer.mlp import MLPConfig
from megamoe.transformer.rope import RopeConfig

__all__ = ["SUPPORTED_FAMILIES", "MTP_FAMILIES", "config_from_hf", "attention_config", "mla_config", "mlp_config",
           "router_config", "balancing_losses", "moe_layer_ids", "declared_mtp_layers",
           "sliding_window_layer_ids"]

logger = logging.getLogger(__name__)

SUPPORTED_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe",
                      "minimax_m2", "gpt_oss")
_MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
MTP_FAMILIES = ("deepseek_v3", "glm4_moe")    # families whose checkpoints may carry multi-token-prediction layers


def declared_mtp_layers(hf_config: dict) -> int:
    """How many MTP layers a config.json dict declares: DeepSeek-V3's "num_nextn_predict_layers" (or
    transformers' alias "num_mtp_layers"), 0 when absent or for another family. Read from the raw dict
    because transformers 5.24's DeepseekV3Config defaults it to 1 whether or not config.json has it, and
    ``save_pretrained`` writes that 1 for models that hold no MTP weights."""
    if hf_config.get("model_type") not in MTP_FAMILIES:
        return 0
    value = hf_config.get("num_nextn_predict_layers", hf_config.get("num_mtp_layers", 0))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"num_nextn_predict_layers must be an int >= 0, got {value!r}")
    return value

# Their HF rotary embeddings read rope_parameters' "partial_rotary_factor" (GLM-4.5: 0.5 by default;
# MiniMax-M2: "rotary_dim" / "head_dim"): only the first part of each head rotates.
_PARTIAL_ROTARY_FAMILIES = ("glm4_moe", "minimax_m2")


def _rope(cfg, dim: int, layout: str = "half") -> RopeConfig:
    return RopeConfig.from_hf(cfg.rope_parameters, dim=dim, max_position_embeddings=cfg.max_position_embeddings,
                              layout=layout, partial_rotary=cfg.model_type in _PARTIAL_ROTARY_FAMILIES)


def _qk_norm(cfg) -> str | None:
    """The q/k norm: per head (qwen3_moe; glm4_moe when "use_qk_norm"), across heads (olmoe, minimax_m2:
    one RMSNorm over all q heads' features, one over all k heads')."""
    family = cfg.model_type
    if family == "glm4_moe":
        return "per_head" if cfg.use_qk_norm else None
    return {"qwen3_moe": "per_head", "olmoe": "full_width", "minimax_m2": "full_width"}.get(family)


_LAYER_TYPE_FAMILIES = ("qwen2_moe", "gpt_oss")      # sliding layers marked by "layer_types"


def sliding_window_layer_ids(cfg) -> tuple[int, ...] | None:
    """The sliding-window layers when "layer_types" mixes sliding and full attention; None when every
    layer has the same attention (the window, if any, is then on all of them)."""
    if cfg.model_type not in _LAYER_TYPE_FAMILIES or getattr(cfg, "sliding_window", None) is None:
        return None
    sliding = tuple(i for i, kind in enumerate(cfg.layer_types) if kind == "sliding_attention")
    return sliding if 0 < len(sliding) < len(cfg.layer_types) else None


def _sliding_window(cfg, layer_idx: int | None) -> int | None:
    if cfg.model_type not in _LAYER_TYPE_FAMILIES:
        return getattr(cfg, "sliding_window", None)
    if layer_idx is not None:
        return cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding_attention" else None
    kinds = set(cfg.layer_types)
    if len(kinds) > 1:
        raise ValueError(f"{cfg.model_type}: layer_types {cfg.layer_types} mix sliding and full attention; pass a "
                         "layer_idx (config_from_hf sets GPTMoEConfig.sliding_window_layer_ids for them)")
    return cfg.sliding_window if kinds == {"sliding_attention"} else None


def attention_config(cfg, layer_idx: int | None = None) -> AttentionConfig:
    """GQA attention of mixtral, qwen2_moe, qwen3_moe, olmoe, glm4_moe and minimax_m2: of layer
    ``layer_idx``, or (None) the one config all layers share (ValueError when qwen2_moe's layers differ in
    their sliding window)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    family = cfg.model_type
    biased = family in ("qwen3_moe", "olmoe", "gpt_oss") and cfg.attention_bias
    qkv_bias = biased
    if family == "qwen2_moe":
        qkv_bias = cfg.qkv_bias
    elif family == "glm4_moe":           # "attention_bias" biases q/k/v only: its o_proj never has one
        qkv_bias = cfg.attention_bias
    return AttentionConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=head_dim, rope=_rope(cfg, head_dim),
        qkv_bias=qkv_bias, o_proj_bias=biased, qk_norm=_qk_norm(cfg), norm_eps=cfg.rms_norm_eps,
        sliding_window=_sliding_window(cfg, layer_idx), clip_qkv=getattr(cfg, "clip_qkv", None),
        init_std=cfg.initializer_range, sinks=family == "gpt_oss")


def mla_config(cfg) -> MLAConfig:
    """DeepSeek-V2 (always interleaved rope) and DeepSeek-V3 (``rope_interleave``)."""
    interleaved = cfg.model_type == "deepseek_v2" or cfg.rope_interleave
    return MLAConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        rope=_rope(cfg, cfg.qk_rope_head_dim, "interleaved" if interleaved else "half"),
        attention_bias=cfg.attention_bias, init_std=cfg.initializer_range)


def mlp_config(cfg) -> MLPConfig:
    """The dense MLP of the layers that are not MoE."""
    return MLPConfig(cfg.hidden_size, cfg.intermediate_size, activation=cfg.hidden_act,
                     bias=getattr(cfg, "mlp_bias", False), init_std=cfg.initializer_range)


def _num_experts(cfg) -> int:
    family = cfg.model_type
    if family in ("mixtral", "minimax_m2", "gpt_oss"):
        return cfg.num_local_experts
    return cfg.n_routed_experts if family in _MLA_FAMILIES + ("glm4_moe",) else cfg.num_experts


def moe_layer_ids(cfg, mtp_num_layers: int = 0) -> tuple[int, ...]:
    """The layers transformers builds with a sparse MoE block; with ``mtp_num_layers`` (DeepSeek-V3) also
    the MTP layers ``num_hidden_layers + k`` the same rule makes MoE (DeepSeek's releases: all of them)."""
    family, layers = cfg.model_type, range(cfg.num_hidden_layers + mtp_num_layers)
    if family in ("mixtral", "olmoe", "minimax_m2", "gpt_oss"):
        return tuple(layers)
    if family == "glm4_moe":             # no "moe_layer_freq" in GLM's config
        return tuple(i for i in layers if i >= cfg.first_k_dense_replace)
    if family in ("qwen2_moe", "qwen3_moe"):
        dense = cfg.mlp_only_layers
        bad = [i for i in dense if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.num_hidden_layers]
        if bad:             # transformers only tests membership: such an entry would silently name no layer
            raise ValueError(f"{family}: mlp_only_layers {list(dense)} holds {bad[0]!r}, not a layer index in "
                             f"[0, num_hidden_layers={cfg.num_hidden_layers})")
        if cfg.num_experts == 0:
            return ()
        return tuple(i for i in layers if i not in dense and (i + 1) % cfg.decoder_sparse_step == 0)
    freq = getattr(cfg, "moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(f"{family}: moe_layer_freq={freq} is not supported: transformers ignores it (every layer "
                         f">= first_k_dense_replace is MoE) while DeepSeek's reference code does not")
    return tuple(i for i in layers if i >= cfg.first_k_dense_replace)


# config.json fields transformers' modeling code never reads, whose other values would describe another
# model than the one it (and megamoe) computes: refused rather than silently run as this one.
_UNREAD_FIELDS = {
    "minimax_m2": {"scoring_func": "sigmoid", "use_routing_bias": True, "shared_intermediate_size": 0,
                   "use_qk_norm": True, "qk_norm_type": "per_layer"},
}


def _refuse_unread_fields(cfg) -> None:
    family = cfg.model_type
    for name, computed in _UNREAD_FIELDS.get(family, {}).items():
        value = getattr(cfg, name, computed)
        if value != computed:
            raise ValueError(f"{family}: {name}={value!r} is not supported: transformers' {family} (and megamoe) "
                             f"compute {name}={computed!r} and ignore the field")
    # MiniMax's "attn_type_list": 1 = softmax attention per layer (0, MiniMax-01's lightning attention, is
    # another model); MiniMax-M2 releases list 1 for every layer.
    kinds = getattr(cfg, "attn_type_list", None) if family == "minimax_m2" else None
    if kinds is not None and any(kind != 1 for kind in kinds):
        raise ValueError(f"minimax_m2: attn_type_list {list(kinds)} has layers other than 1 (softmax attention); "
                         "transformers' minimax_m2 (and megamoe) run softmax attention on every layer")


_DEEPSEEK_AUX_LOSS_ALPHA = 0.001   # DeepSeek's configuration_deepseek.py default ("aux_loss_alpha", "seq_aux" True)


def balancing_losses(cfg, for_training: bool = True) -> dict[str, float]:
    """The RouterConfig loss coefficients of the family's load balancing (see the module docstring)."""
    family = cfg.model_type
    # HF's load_balancing_loss_func:
    if family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "minimax_m2", "gpt_oss"):
        on = for_training or cfg.output_router_logits
        return {"aux_loss_coeff": cfg.router_aux_loss_coef * cfg.num_experts_per_tok if on else 0.0}
    if not for_training:
        return {}
    alpha = getattr(cfg, "aux_loss_alpha", None)
    if alpha is None:
        alpha = _DEEPSEEK_AUX_LOSS_ALPHA if family == "deepseek_v2" else 0.0
    return {"seq_aux_loss_coeff" if getattr(cfg, "seq_aux", True) else "aux_loss_coeff": float(alpha)}


def router_config(cfg, for_training: bool = True) -> RouterConfig:
    """The router of one MoE layer (see the family table in :mod:`megamoe.moe.router`), with the
    balancing of :func:`balancing_losses`."""
    family = cfg.model_type
    top_k = cfg.num_experts_per_tok
    common = dict(hidden_size=cfg.hidden_size, num_experts=_num_experts(cfg), top_k=top_k,
                  init_std=cfg.initializer_range, **balancing_losses(cfg, for_training))
    if family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        return RouterConfig(**common, score_func="softmax", norm_topk_prob=family == "mixtral" or cfg.norm_topk_prob)
    if family == "minimax_m2":
        # sigmoid scores, selection by score + e_score_correction_bias, the selected scores renormalised;
        # no groups, no scaling (transformers' MiniMaxM2TopKRouter).
        return RouterConfig(**common, score_func="sigmoid", norm_topk_prob=True, use_expert_bias=True)
    if family == "gpt_oss":     # softmax over the top-k logits = the top-k softmax scores renormalised
        return RouterConfig(**common, score_func="softmax", norm_topk_prob=True, bias=True)
    if family == "deepseek_v2":
        if cfg.topk_method == "greedy":
            groups = {}
        elif cfg.topk_method == "group_limited_greedy":
            groups = dict(n_group=cfg.n_group, topk_group=cfg.topk_group, group_score="max")
        else:
            raise ValueError(f"deepseek_v2: topk_method {cfg.topk_method!r} is not supported; supported: "
                             "'greedy', 'group_limited_greedy'")
        return RouterConfig(**common, score_func="softmax", routed_scaling_factor=cfg.routed_scaling_factor,
                            **groups)
    return RouterConfig(**common, score_func="sigmoid", norm_topk_prob=bool(cfg.norm_topk_prob),
                        routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group or 1,
                        topk_group=cfg.topk_group or 1, group_score="top2_sum", use_expert_bias=True)


def _shared_experts(cfg) -> SharedExpertsConfig | None:
    family = cfg.model_type
    if family == "qwen2_moe":
        return SharedExpertsConfig(cfg.hidden_size, cfg.shared_expert_intermediate_size, gate=True,
                                   init_std=cfg.initializer_range)
    if family in _MLA_FAMILIES + ("glm4_moe",) and cfg.n_shared_experts:
        if getattr(cfg, "mlp_bias", False):
            raise ValueError(f"{family}: mlp_bias=True gives the shared experts biases, which are not supported")
        return SharedExpertsConfig(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size,
                                   init_std=cfg.initializer_range)
    return None


def config_from_hf(hf_config, *, dispatcher: str = DEFAULT_DISPATCHER, expert_backend: str = "auto",
                   num_expert_slots: int | None = None, for_training: bool = True,
                   mtp_num_layers: int = 0) -> GPTMoEConfig:
    """The :class:`GPTMoEConfig` reproducing a transformers config of a supported family.

    ``dispatcher``, ``expert_backend`` and ``num_expert_slots`` are engine choices (see
    :class:`MoEConfig`); everything else comes from ``hf_config``. Training-only randomness HF applies
    (attention dropout, Mixtral's router jitter) is not reproduced and only logged. ``for_training``
    (default) sets the family's load balancing for training, ``False`` the balancing losses HF's own
    forward adds (see the module docstring); the logits are the same either way. ``mtp_num_layers``:
    the DeepSeek-V3 multi-token-prediction layers to build (:mod:`megamoe.models.mtp`); the caller decides
    (:func:`declared_mtp_layers` of the raw config.json, or 0 when the checkpoint holds no MTP weights), as
    transformers' config object cannot say whether config.json declared them.
    """
    family = getattr(hf_config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    cfg = hf_config
    _refuse_unread_fields(cfg)
    for name in ("attention_dropout", "router_jitter_noise"):
        if getattr(cfg, name, 0.0):
            logger.warning("%s: %s=%s is ignored (training-time noise is not reproduced)", family, name,
                           getattr(cfg, name))
    if mtp_num_layers and family not in MTP_FAMILIES:
        raise ValueError(f"{family}: mtp_num_layers={mtp_num_layers}, but only {', '.join(MTP_FAMILIES)} has "
                         "multi-token-prediction layers")
    layer_ids = moe_layer_ids(cfg, mtp_num_layers)
    moe = None
    if layer_ids:
        if cfg.hidden_act != "silu":
            raise ValueError(f"{family}: hidden_act {cfg.hidden_act!r}: gated experts are supported with 'silu' "
                             "(SwiGLU) only")
        ffn = (cfg.intermediate_size if family in ("mixtral", "olmoe", "minimax_m2", "gpt_oss")
               else cfg.moe_intermediate_size)
        gpt_oss = family == "gpt_oss"
        activation = dict(activation="swiglu_clamped", expert_bias=True, swiglu_alpha=cfg.swiglu_alpha,
                          swiglu_limit=cfg.swiglu_limit) if gpt_oss else dict(activation="swiglu")
        moe = MoEConfig(router=router_config(cfg, for_training), ffn_hidden_size=ffn,
                        num_expert_slots=num_expert_slots, dispatcher=dispatcher, expert_backend=expert_backend,
                        **activation, shared_experts=_shared_experts(cfg), init_std=cfg.initializer_range)
    dense = mlp_config(cfg) if len(layer_ids) < cfg.num_hidden_layers + mtp_num_layers else None
    window_layers = sliding_window_layer_ids(cfg)
    attention = (mla_config(cfg) if family in _MLA_FAMILIES
                 else attention_config(cfg, window_layers[0] if window_layers else None))
    return GPTMoEConfig(
        family=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
        attention=attention, moe=moe, moe_layer_ids=layer_ids, dense_mlp=dense, norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(cfg.tie_word_embeddings), init_std=cfg.initializer_range,
        sliding_window_layer_ids=window_layers, mtp_num_layers=mtp_num_layers)
