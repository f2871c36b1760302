"""The HF adapter of each supported model family, by HF ``model_type``: each family's key map is a module of
:mod:`megamoe.hf.families` (as torchtitan's ``models/<family>/state_dict_adapter.py``), on the shared machinery
and key tables of :mod:`megamoe.hf.adapter`."""

from __future__ import annotations

from megamoe.hf.adapter import AdapterError, HFAdapter, KeyTransform
from megamoe.hf.families import (deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, minimax_m2, mixtral, olmoe, qwen2_moe,
                                 qwen3_moe)

__all__ = ["AdapterError", "KeyTransform", "HFAdapter", "ADAPTERS", "adapter_for"]

ADAPTERS: dict[str, HFAdapter] = {family.ADAPTER.model_type: family.ADAPTER for family in (
    mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3, glm4_moe, minimax_m2, gpt_oss)}


def adapter_for(model_type: str) -> HFAdapter:
    """The adapter of an HF ``model_type``; ValueError listing the supported ones otherwise."""
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise ValueError(f"no HF adapter for model_type {model_type!r}; supported: {', '.join(ADAPTERS)}") from None
