"""OLMoE's HF key map (GQA attention, routed experts only)."""

from __future__ import annotations

from megamoe.hf.adapter import DENSE_MLP_KEYS, GQA_LAYER_KEYS, STANDARD_EXPERTS, HFAdapter, router_keys

__all__ = ["ADAPTER"]

ADAPTER = HFAdapter("olmoe", GQA_LAYER_KEYS, DENSE_MLP_KEYS, router_keys("mlp"), STANDARD_EXPERTS)
