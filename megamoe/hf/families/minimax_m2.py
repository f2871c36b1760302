"""MiniMax-M2's HF key map: checkpoints keep Mixtral's ``block_sparse_moe`` names; the selection bias sits
on the block, not on its gate."""

from __future__ import annotations

from megamoe.hf.adapter import (DENSE_MLP_KEYS, GQA_LAYER_KEYS, MIXTRAL_EXPERT_KEYS, STANDARD_EXPERTS, ExpertKeys,
                                HFAdapter, block_router_keys)

__all__ = ["ADAPTER"]

ADAPTER = HFAdapter(
    "minimax_m2", GQA_LAYER_KEYS, DENSE_MLP_KEYS,
    moe_keys=block_router_keys("block_sparse_moe", fused=False) + block_router_keys("mlp", fused=True),
    experts=ExpertKeys(per_expert=MIXTRAL_EXPERT_KEYS, fused=STANDARD_EXPERTS.fused))
