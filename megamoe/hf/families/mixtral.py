"""Mixtral's HF key map (its checkpoints keep the original ``block_sparse_moe`` names and w1 / w3 / w2)."""

from __future__ import annotations

from megamoe.hf.adapter import (DENSE_MLP_KEYS, GQA_LAYER_KEYS, MIXTRAL_EXPERT_KEYS, STANDARD_EXPERTS, ExpertKeys,
                                HFAdapter, router_keys)

__all__ = ["ADAPTER"]

ADAPTER = HFAdapter(
    "mixtral", GQA_LAYER_KEYS, DENSE_MLP_KEYS,
    moe_keys=router_keys("block_sparse_moe", fused=False) + router_keys("mlp", fused=True),
    experts=ExpertKeys(per_expert=MIXTRAL_EXPERT_KEYS, fused=STANDARD_EXPERTS.fused))
