"""``apply_lora(model, config)``: freeze the base and give the configured weights LoRA adapters, in place.

Which modules get adapters for each target is :func:`_dense_owners` (dense weights, :mod:`megamoe.lora.dense`)
and the MoE layers' routed experts (:mod:`megamoe.moe.experts.lora_experts`). Each adapter's ``A`` is drawn
as PEFT draws it from a generator seeded by ``(seed, "lora." + <logical name of the base weight>)``, so the
same seed gives the same adapters under every TP / EP / PP layout; ``B`` starts at zero (the adapted model
computes what the base does until the first step).

Adapters are fp32 over a bf16 / fp16 / FP8 base (PEFT's ``autocast_adapter_dtype``), in the base's dtype
otherwise.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from megamoe.lora.config import LoRAConfig
from megamoe.lora.dense import DenseAdapter, DenseAdapters
from megamoe.moe.experts.lora_experts import ExpertAdapters
from megamoe.moe.moe_layer import MoELayer
from megamoe.moe.router import Router
from megamoe.moe.shared_experts import SharedExperts
from megamoe.tensor_parallel.init import seeded_generator
from megamoe.transformer.attention import Attention
from megamoe.transformer.mla import MultiHeadLatentAttention
from megamoe.transformer.mlp import MLP

__all__ = ["apply_lora", "lora_parameters"]

logger = logging.getLogger(__name__)

_ATTENTION_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "k_proj", "v_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                          "o_proj")


def _adapter_dtype(weight: torch.Tensor) -> torch.dtype:
    return weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32


def _dense_owners(module: nn.Module, targets: tuple[str, ...]):
    """``(target, owner, attr, group)`` for every dense weight of ``module`` (not its children) to adapt."""
    if "attention" in targets and isinstance(module, (Attention, MultiHeadLatentAttention)):
        for name in _ATTENTION_PROJECTIONS:
            child = getattr(module, name, None)
            if child is not None:
                yield "attention", child, "weight", getattr(child, "tp_group", None)
    elif "dense_mlp" in targets and isinstance(module, MLP):
        for child in (module.gate_proj, module.up_proj, module.down_proj):
            if child is not None:
                yield "dense_mlp", child, "weight", child.tp_group
    elif "shared_experts" in targets and isinstance(module, SharedExperts):
        for attr in (("gate_proj",) if module.gated else ()) + ("up_proj", "down_proj"):
            yield "shared_experts", module, attr, module.shard_group
    elif "router" in targets and isinstance(module, Router):
        yield "router", module, "weight", None


def apply_lora(model: nn.Module, config: LoRAConfig, *, seed: int = 0) -> None:
    """Freeze every parameter of ``model`` and add the adapters ``config`` asks for (see the module docstring).

    ValueError when the model has none of the targets, when ``dropout`` > 0 meets a dense target (dense adapters are added to the weight, which has no
    input dropout, like PEFT's ``target_parameters``), or when a layout cannot carry adapters (named)."""
    if not isinstance(config, LoRAConfig):
        raise ValueError(f"apply_lora needs a LoRAConfig, got {type(config).__name__}")
    if any(m._modules.get("lora_adapters") is not None for m in model.modules()):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    for param in model.parameters():
        param.requires_grad_(False)
    found: dict[str, int] = {t: 0 for t in config.targets}
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        owners = list(_dense_owners(module, config.targets))
        for target, owner, attr, group in owners:
            if config.dropout > 0:
                raise ValueError(f"LoRAConfig.dropout ({config.dropout}) applies to the routed experts' adapters "
                                 f"only: the {target!r} adapters are added to the weight (as PEFT's "
                                 "target_parameters), which has no input dropout; use dropout 0 or targets=experts")
            owner_prefix = prefix if owner is module else f"{prefix}{_child_name(module, owner)}."
            base_name = f"{owner_prefix}{attr}"
            weight = getattr(owner, attr)
            adapters = owner._modules.get("lora_adapters")
            if adapters is None:
                adapters = DenseAdapters()
                owner.add_module("lora_adapters", adapters)
            adapter = DenseAdapter(weight, config.rank, config.scaling, group=group, name=base_name,
                                   dtype=_adapter_dtype(weight))
            adapters.add_module(attr, adapter)
            adapter.reset_parameters(seeded_generator(seed, f"lora.{base_name}"))
            found[target] += 1
        if "experts" in config.targets and isinstance(module, MoELayer):
            experts = module.experts
            weight = experts.slot_parameters(0)[0][0]
            adapters = ExpertAdapters(
                experts, module.config.num_experts, config.rank, config.scaling, config.dropout,
                slot_experts=_slot_experts_of(module), etp_group=module.etp_group, ep_group=module.ep_group,
                dtype=_adapter_dtype(weight))
            experts.add_module("lora_adapters", adapters)
            adapters.reset_parameters(lambda rel, p=f"{prefix}experts.": seeded_generator(seed, f"lora.{p}{rel}"))
            found["experts"] += 1
    missing = [t for t, n in found.items() if n == 0]
    if len(missing) == len(found):
        raise ValueError(f"LoRAConfig.targets: the model has no {', '.join(missing)} weights to adapt (this stage, "
                         "for a pipeline stage); choose targets it has")
    if missing:      # e.g. the default targets on a model without shared experts
        logger.info("LoRA: the model has no %s weights (no adapters there)", ", ".join(missing))
    trainable = sum(p.numel() for p in lora_parameters(model))
    logger.info("LoRA rank %d alpha %g on %s: %d adapter parameters", config.rank, config.alpha,
                ", ".join(f"{t} ({n})" for t, n in found.items()), trainable)


def _child_name(module: nn.Module, child: nn.Module) -> str:
    for name, c in module.named_children():
        if c is child:
            return name
    raise ValueError("not a child")


def _slot_experts_of(layer: MoELayer):
    """The expert of each of ``layer``'s local slots, read from its placement at every call (EPLB replaces it)."""
    def slot_experts() -> torch.Tensor:
        slots = layer.local_slots
        return layer.placement.slot_to_expert[slots.start:slots.stop]
    return slot_experts


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters (what the optimizer updates), in module order."""
    return [p for m in model.modules() if isinstance(m, (DenseAdapter, ExpertAdapters)) for p in m.parameters()]
