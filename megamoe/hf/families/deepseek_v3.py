"""DeepSeek-V3's HF key map: MLA attention, shared experts, multi-token-prediction layers."""

from __future__ import annotations

from megamoe.hf.adapter import (DENSE_MLP_KEYS, MLA_LAYER_KEYS, MTP_OWN_KEYS, STANDARD_EXPERTS, HFAdapter,
                                past_last_layer, router_keys, shared_expert_keys, tied_lm_head)

__all__ = ["ADAPTER"]

ADAPTER = HFAdapter("deepseek_v3", MLA_LAYER_KEYS, DENSE_MLP_KEYS,
                    router_keys("mlp") + shared_expert_keys("shared_experts"), STANDARD_EXPERTS,
                    ignored=(tied_lm_head, past_last_layer), mtp_keys=MTP_OWN_KEYS)
