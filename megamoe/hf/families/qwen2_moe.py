"""Qwen2-MoE's HF key map: a gated shared expert (``mlp.shared_expert`` + ``mlp.shared_expert_gate``)."""

from __future__ import annotations

from megamoe.hf.adapter import (DENSE_MLP_KEYS, GQA_LAYER_KEYS, SHARED_EXPERT_GATE_KEY, STANDARD_EXPERTS, HFAdapter,
                                router_keys, shared_expert_keys)

__all__ = ["ADAPTER"]

ADAPTER = HFAdapter(
    "qwen2_moe", GQA_LAYER_KEYS, DENSE_MLP_KEYS,
    moe_keys=router_keys("mlp") + shared_expert_keys("shared_expert") + (SHARED_EXPERT_GATE_KEY,),
    experts=STANDARD_EXPERTS)
