"""LoRA fine-tuning: adapters on attention, dense MLPs, shared experts, routed experts and routers, over a frozen
base (high precision or kept block-FP8), sharded like the base under TP / ETP / EP / PP.

- :class:`LoRAConfig` (:mod:`megamoe.lora.config`): rank, alpha, dropout, targets; ``scaling = alpha / rank``.
- :func:`apply_lora` (:mod:`megamoe.lora.apply`): freeze the base, add the adapters in place.
- :func:`lora_state_dict`, :func:`merge_lora` (:mod:`megamoe.lora.state`): adapters keyed by their base
  weights' logical names; the merged weights in the megamoe layout.

The math is PEFT's, see :mod:`megamoe.lora.dense` and :mod:`megamoe.moe.experts.lora_experts`.
"""

from megamoe.lora.apply import apply_lora, lora_parameters
from megamoe.lora.config import DEFAULT_LORA_TARGETS, LORA_TARGETS, LoRAConfig
from megamoe.lora.state import LORA_SUFFIXES, load_lora_state_dict, lora_chunks, lora_state_dict, merge_lora

__all__ = ["LoRAConfig", "LORA_TARGETS", "DEFAULT_LORA_TARGETS", "apply_lora", "lora_parameters", "lora_chunks",
           "lora_state_dict", "load_lora_state_dict", "merge_lora", "LORA_SUFFIXES"]
