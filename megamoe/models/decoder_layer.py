"""One decoder layer of :class:`~megamoe.models.gpt_moe.GPTMoEModel`: pre-norm attention and a pre-norm MoE or
dense MLP, both residual. Its own module so that the multi-token-prediction layer (:mod:`megamoe.models.mtp`),
which builds on it, and the model, which builds both, import it without importing each other.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from megamoe.models.config import GPTMoEConfig
from megamoe.models.layer_spec import LayerSpec
from megamoe.moe.moe_layer import MoELayer
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.parallel_plan import ParallelPlan, build_parallel_plan
from megamoe.transformer import RMSNorm
from megamoe.transformer.mla import MLAConfig
from megamoe.transformer.recompute import checkpointed, set_module_flag

__all__ = ["DecoderLayer"]


class DecoderLayer(nn.Module):
    """pre-norm attention + pre-norm (MoE or dense) MLP, both residual. HF module names. The attention,
    dense MLP and MoE layer are built by ``layer_spec`` (:class:`LayerSpec`; default: the shipped classes).
    ``config.recompute``'s selective modules apply here (see :mod:`megamoe.models.gpt_moe`); a custom module
    without the matching flag logs a warning and is not recomputed inside."""

    def __init__(self, config: GPTMoEConfig, layer_id: int, state, *, placement: ExpertPlacement | None = None,
                 layer_spec: LayerSpec | None = None, plan: ParallelPlan | None = None, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        spec = layer_spec or LayerSpec()
        plan = plan or build_parallel_plan(config, state)       # the model passes its own (built once)
        tp = plan.group(plan.dense.weight_group)
        sequence_group = plan.group(plan.dense.sequence_group)
        sp = sequence_group is not None
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, **factory)
        cp_group = plan.group(plan.dense.context_group)
        self.self_attn = spec.build_attention(config.attention_of(layer_id), tp_group=tp, sequence_parallel=sp,
                                              cp_group=cp_group, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, **factory)
        if config.is_moe_layer(layer_id):
            moe = plan.moe
            extra = {"sequence_group": sequence_group} if sp else {}
            if moe.folded:                  # MoE parallel folding: each TP rank takes its own share
                extra["fold_group"] = plan.group(moe.token_split_group)
            if cp_group is not None:        # balancing statistics over the whole sequences
                extra["statistics_group"] = plan.group(moe.statistics_group)
                extra["context_parallel_size"] = plan.cp
            self.mlp = spec.build_moe(config.moe, ep_group=plan.group(moe.slot_group),
                                      etp_group=plan.group(moe.expert_shard_group),
                                      expert_group=plan.group("ep_etp"), etp_edp_group=plan.group("etp_edp"),
                                      placement=placement, **extra, **factory)
        else:
            self.mlp = spec.build_mlp(config.dense_mlp, tp_group=tp, sequence_parallel=sp, **factory)
        if sp:      # the norms see this rank's sequence chunk only: gradients summed over TP
            for param in (*self.input_layernorm.parameters(), *self.post_attention_layernorm.parameters()):
                param.sequence_parallel = True
        # A custom attention module written before packed documents existed keeps working without them.
        parameters = inspect.signature(self.self_attn.forward).parameters.values()
        self.attention_takes_document_ids = any(p.name == "document_ids" or p.kind is p.VAR_KEYWORD
                                                for p in parameters)
        recompute = config.recompute
        self.recompute_layernorm = recompute.recomputes("layernorm")
        self.recompute_mlp = recompute.recomputes("moe" if config.is_moe_layer(layer_id) else "mlp")
        set_module_flag(self.self_attn, "recompute_core_attn", recompute.recomputes("core_attn"), "core_attn")
        if isinstance(config.attention, MLAConfig):       # GQA has no up projections: nothing to recompute
            set_module_flag(self.self_attn, "recompute_up_proj", recompute.recomputes("mla_up_proj"), "mla_up_proj")
        if config.is_moe_layer(layer_id):
            set_module_flag(getattr(self.mlp, "experts", self.mlp), "recompute_activation",
                            recompute.recomputes("moe_act"), "moe_act")

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, kv_cache=None,
                attention_mask: torch.Tensor | None = None, mlp_token_index: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                mlp_token_mask: torch.Tensor | None = None, document_ids: torch.Tensor | None = None):
        """[B, S, H] -> ([B, S, H], aux_loss []). ``attention_mask`` [B, S_past + S] hides padding keys;
        ``mlp_token_index`` [T] (flat indices into the B * S tokens): only these tokens go through
        the MLP, the others (padding) keep the attention output alone; ``position_embeddings``: the
        rotary (cos, sin) of ``position_ids``, when the caller computed them once for all layers;
        ``mlp_token_mask`` [B * S] (the static-shape alternative to ``mlp_token_index``): every token
        goes through the MLP, but those masked out reach no expert of a MoE layer; ``document_ids``
        [B, S]: document-causal attention over packed documents (passed to the attention as a keyword,
        only when given)."""
        packing = {}
        if document_ids is not None:
            if not self.attention_takes_document_ids:
                raise ValueError(f"layer {self.layer_id}'s attention {type(self.self_attn).__name__} has no "
                                 "document_ids keyword in its forward, so it cannot mask packed documents; add "
                                 "`document_ids=None` to its forward and pass it to causal_attention, or train "
                                 "without reset_attention_mask")
            packing["document_ids"] = document_ids
        normed = checkpointed(self.input_layernorm, hidden, enabled=self.recompute_layernorm)
        hidden = hidden + self.self_attn(normed, position_ids, kv_cache, attention_mask, position_embeddings, **packing)
        normed = checkpointed(self.post_attention_layernorm, hidden, enabled=self.recompute_layernorm)
        if mlp_token_index is not None:
            normed = normed.reshape(-1, normed.shape[-1]).index_select(0, mlp_token_index)   # [T, H]
        if mlp_token_mask is not None and isinstance(self.mlp, MoELayer):
            mlp_out = checkpointed(self.mlp, normed, token_mask=mlp_token_mask, enabled=self.recompute_mlp)
        else:
            mlp_out = checkpointed(self.mlp, normed, enabled=self.recompute_mlp)
        if isinstance(mlp_out, tuple):
            mlp_out, aux_loss = mlp_out
        else:
            aux_loss = hidden.new_zeros((), dtype=torch.float32)
        if mlp_token_index is not None:
            flat = hidden.reshape(-1, hidden.shape[-1])
            return flat.index_add(0, mlp_token_index, mlp_out).view_as(hidden), aux_loss
        return hidden + mlp_out, aux_loss
