"""DeepSeek-V2's HF key map: MLA attention, shared experts."""

from __future__ import annotations

from megamoe.hf.adapter import (DENSE_MLP_KEYS, MLA_LAYER_KEYS, STANDARD_EXPERTS, HFAdapter, router_keys,
                                shared_expert_keys)

__all__ = ["ADAPTER"]

ADAPTER = HFAdapter("deepseek_v2", MLA_LAYER_KEYS, DENSE_MLP_KEYS,
                    router_keys("mlp") + shared_expert_keys("shared_experts"), STANDARD_EXPERTS)
