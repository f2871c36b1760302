"""The parameter tensors a rank holds for a :class:`~megamoe.models.GPTMoEConfig` under a layout, counted
from the config alone (no model is built): the same shard rules as the modules (vocabulary padded and split
over TP, heads and dense FFN over TP, expert slots over EP with their FFN over ETP, shared experts over the
MoE layer's reduction group, norms, routers and MLA's low-rank projections replicated).

Read by the training memory estimate (:mod:`megamoe.training.memory_estimate`), generation's memory check
(:mod:`megamoe.inference.generation_memory`) and the training script's parameter report."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megamoe.models.config import GPTMoEConfig
from megamoe.moe.token_dispatcher import dispatcher_class
from megamoe.pipeline.partition import partition_layers
from megamoe.tensor_parallel.vocab_padding import padded_vocab_size
from megamoe.transformer.attention import AttentionConfig
from megamoe.transformer.mla import MLAConfig

__all__ = ["ParamTensor", "stage_parameters", "model_parameter_counts", "vocab_rows_per_rank"]


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of a rank: its local element count, whether it is an expert parameter
    (reduced over expert-DP), and its name (for reports)."""

    name: str
    numel: int
    expert: bool = False
    rows: int = 1           # expert parameters stacked by slot: one row per local slot, each sharded alone



def _linear(name: str, out_local: int, in_local: int, bias: int | None = None, expert: bool = False):
    out = [ParamTensor(f"{name}.weight", out_local * in_local, expert)]
    if bias:
        out.append(ParamTensor(f"{name}.bias", bias, expert))
    return out


def _attention_params(cfg: AttentionConfig | MLAConfig, tp: int, prefix: str) -> list[ParamTensor]:
    H, heads = cfg.hidden_size, cfg.num_attention_heads
    if heads % tp:
        raise ValueError(f"num_attention_heads ({heads}) must be divisible by tp ({tp})")
    if isinstance(cfg, MLAConfig):
        out: list[ParamTensor] = []
        q_out = heads * cfg.qk_head_dim
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            out += _linear(f"{prefix}.q_proj", q_out // tp, H)
        else:
            out += _linear(f"{prefix}.q_a_proj", cfg.q_lora_rank, H, cfg.q_lora_rank if bias else None)
            out += [ParamTensor(f"{prefix}.q_a_layernorm.weight", cfg.q_lora_rank)]
            out += _linear(f"{prefix}.q_b_proj", q_out // tp, cfg.q_lora_rank)
        kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        out += _linear(f"{prefix}.kv_a_proj_with_mqa", kv_a, H, kv_a if bias else None)
        out += [ParamTensor(f"{prefix}.kv_a_layernorm.weight", cfg.kv_lora_rank)]
        out += _linear(f"{prefix}.kv_b_proj", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) // tp, cfg.kv_lora_rank)
        out += _linear(f"{prefix}.o_proj", H, heads * cfg.v_head_dim // tp, H if bias else None)
        return out
    d, kv = cfg.head_dim, cfg.num_key_value_heads
    kv_count = min(tp, kv)            # KV heads: min(tp, kv) shards, replicated beyond (head_sharding)
    if kv % kv_count or (tp > kv and tp % kv):
        raise ValueError(f"num_key_value_heads ({kv}) and tp ({tp}): one must divide the other")
    q_local, kv_local = heads * d // tp, kv * d // kv_count
    out = _linear(f"{prefix}.q_proj", q_local, H, q_local if cfg.qkv_bias else None)
    out += _linear(f"{prefix}.k_proj", kv_local, H, kv_local if cfg.qkv_bias else None)
    out += _linear(f"{prefix}.v_proj", kv_local, H, kv_local if cfg.qkv_bias else None)
    out += _linear(f"{prefix}.o_proj", H, q_local, H if cfg.o_proj_bias else None)
    if getattr(cfg, "sinks", False):
        out += [ParamTensor(f"{prefix}.sinks", heads // tp)]
    if cfg.qk_norm == "per_head":
        out += [ParamTensor(f"{prefix}.q_norm.weight", d), ParamTensor(f"{prefix}.k_norm.weight", d)]
    elif cfg.qk_norm == "full_width":
        out += [ParamTensor(f"{prefix}.q_norm.weight", heads * d // min(tp, heads)),
                ParamTensor(f"{prefix}.k_norm.weight", kv_local)]
    return out


def _moe_params(config: GPTMoEConfig, prefix: str, *, tp: int, ep: int, etp: int, slots: int) -> list[ParamTensor]:
    moe = config.moe
    H, F = moe.hidden_size, moe.ffn_hidden_size
    if slots % ep:
        raise ValueError(f"num_expert_slots ({slots}) must be divisible by ep ({ep})")
    if F % etp:
        raise ValueError(f"moe.ffn_hidden_size ({F}) must be divisible by etp ({etp})")
    local = slots // ep
    gated = 2 if moe.activation in ("swiglu", "swiglu_clamped") else 1
    out = [ParamTensor(f"{prefix}.router.weight", moe.num_experts * H),
           ParamTensor(f"{prefix}.experts.w_gate_up", local * gated * (F // etp) * H, True, local),
           ParamTensor(f"{prefix}.experts.w_down", local * H * (F // etp), True, local)]
    if moe.router.bias:
        out += [ParamTensor(f"{prefix}.router.bias", moe.num_experts)]
    if moe.expert_bias:
        out += [ParamTensor(f"{prefix}.experts.b_gate_up", local * gated * (F // etp), True, local),
                ParamTensor(f"{prefix}.experts.b_down", local * H, True, local)]
    if moe.shared_experts is not None:
        se = moe.shared_experts
        n = dispatcher_class(moe.dispatcher).reduce_group_size(ep, etp)   # the dispatcher's reduction group
        if se.ffn_hidden_size % n:
            raise ValueError(f"shared_experts.ffn_hidden_size ({se.ffn_hidden_size}) must be divisible by {n}")
        fs = se.ffn_hidden_size // n
        names = ("gate_proj", "up_proj") if se.activation == "swiglu" else ("up_proj",)
        out += [ParamTensor(f"{prefix}.shared_experts.{name}", fs * H) for name in names]
        out += [ParamTensor(f"{prefix}.shared_experts.down_proj", H * fs)]
        if se.gate:
            out += [ParamTensor(f"{prefix}.shared_experts.gate_weight", H)]
    return out


def stage_parameters(config: GPTMoEConfig, *, tp: int = 1, pp: int = 1, pp_rank: int = 0, ep: int = 1,
                     etp: int = 1, num_expert_slots: int | None = None, pp_split=None) -> list[ParamTensor]:
    """Every parameter tensor a rank of pipeline stage ``pp_rank`` holds, at its local size."""
    slots = num_expert_slots or (config.moe.num_expert_slots if config.moe is not None else 0)
    layer_ids = partition_layers(config.num_layers, pp, pp_split)[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp - 1
    H, V_local = config.hidden_size, vocab_rows_per_rank(config, tp)
    out: list[ParamTensor] = []
    if first or (last and config.tie_word_embeddings):
        out.append(ParamTensor("embed_tokens.weight", V_local * H))
    moe_ids = frozenset(config.moe_layer_ids)       # config.is_moe_layer scans a tuple: quadratic in layers
    for i in layer_ids:
        out += _layer_params(config, i, i in moe_ids, tp=tp, ep=ep, etp=etp, slots=slots)
    if last:
        # The MTP depths (megamoe.models.mtp) after the decoder layers: a decoder layer each, plus enorm,
        # hnorm, eh_proj [H, 2H] and shared_head.norm, replicated over TP.
        for i in range(config.num_layers, config.num_layers + config.mtp_num_layers):
            out += _layer_params(config, i, i in moe_ids, tp=tp, ep=ep, etp=etp, slots=slots)
            out += [ParamTensor(f"layers.{i}.{name}.weight", H) for name in ("enorm", "hnorm", "shared_head.norm")]
            out += [ParamTensor(f"layers.{i}.eh_proj.weight", 2 * H * H)]
        out.append(ParamTensor("norm.weight", H))
        if not config.tie_word_embeddings:
            out.append(ParamTensor("lm_head.weight", V_local * H))
    return out


def _layer_params(config: GPTMoEConfig, i: int, moe: bool, *, tp: int, ep: int, etp: int,
                  slots: int) -> list[ParamTensor]:
    p, H = f"layers.{i}", config.hidden_size
    out = [ParamTensor(f"{p}.input_layernorm.weight", H), ParamTensor(f"{p}.post_attention_layernorm.weight", H)]
    out += _attention_params(config.attention, tp, f"{p}.self_attn")
    if moe:
        return out + _moe_params(config, f"{p}.mlp", tp=tp, ep=ep, etp=etp, slots=slots)
    mlp = config.dense_mlp
    if mlp.intermediate_size % tp:
        raise ValueError(f"dense_mlp.intermediate_size ({mlp.intermediate_size}) must be divisible by tp")
    f_local = mlp.intermediate_size // tp
    bias = f_local if mlp.bias else None
    if mlp.gated:
        out += _linear(f"{p}.mlp.gate_proj", f_local, H, bias)
    out += _linear(f"{p}.mlp.up_proj", f_local, H, bias)
    return out + _linear(f"{p}.mlp.down_proj", H, f_local, H if mlp.bias else None)


def model_parameter_counts(config: GPTMoEConfig) -> tuple[int, int]:
    """``(total, active)`` parameters of the whole model (MTP layers included): every expert once (replica
    slots are copies), and of them what a token runs through, ``top_k`` of ``num_experts`` per MoE layer.
    Counted per kind of layer (every MoE layer, and every dense one, holds the same), so that an absurd
    layer count is counted at once."""
    experts = config.moe.num_experts if config.moe is not None else 0
    H, V = config.hidden_size, vocab_rows_per_rank(config, 1)
    params = [ParamTensor("embed_tokens.weight", V * H), ParamTensor("norm.weight", H)]
    if not config.tie_word_embeddings:
        params.append(ParamTensor("lm_head.weight", V * H))
    layer_ids = range(config.num_layers + config.mtp_num_layers)
    moe_layers = len(frozenset(config.moe_layer_ids).intersection(layer_ids))
    for moe, count in ((True, moe_layers), (False, len(layer_ids) - moe_layers)):
        if count:
            one = _layer_params(config, 0, moe, tp=1, ep=1, etp=1, slots=experts)
            params += [dataclasses.replace(p, numel=p.numel * count) for p in one]
    dense = sum(p.numel for p in params if not p.expert) + config.mtp_num_layers * (3 * H + 2 * H * H)
    expert = sum(p.numel for p in params if p.expert)
    return dense + expert, dense + (expert * config.moe.router.top_k // experts if experts else 0)


def vocab_rows_per_rank(config: GPTMoEConfig, tp: int) -> int:
    """The vocabulary rows of a TP rank's embedding / output layer: the padded vocabulary's share
    (megamoe.tensor_parallel.vocab_padding), padding rows included."""
    return padded_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by) // tp
