"""PEFT on the tiny HF models as the oracle of megamoe's LoRA, and the key map between the two (test side:
megamoe's logical adapter keys <-> PEFT's modules, through the family's HF key map)."""

from __future__ import annotations

import copy
import re
from unittest import mock

import torch

from megamoe.hf.adapters import adapter_for
from megamoe.lora import LoRAConfig, lora_parameters, lora_state_dict

_PEFT_MODULES = {
    "attention": r"self_attn\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)",
    "dense_mlp": r"layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)",
    "shared_experts": r"mlp\.shared_experts?\.(gate_proj|up_proj|down_proj)",
}


def peft_model(hf, config: LoRAConfig, seed: int = 0):
    """A PEFT copy of the HF model ``hf`` with ``config``'s adapters (fused 3-D experts through
    ``target_parameters``), every adapter weight random (B too, so every gradient is informative)."""
    from peft import LoraConfig, get_peft_model
    modules = [_PEFT_MODULES[t] for t in config.targets if t in _PEFT_MODULES]
    parameters = (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if "experts" in config.targets else []) + (
        ["mlp.gate.weight"] if "router" in config.targets else [])
    peft_config = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                             target_modules=r".*\.(" + "|".join(modules) + ")" if modules else None,
                             target_parameters=parameters or None)
    # PEFT 0.21 rewrites the targets of a transformers-5 MoE model for adapters trained on transformers 4: every
    # target named gate_proj / up_proj / down_proj becomes the fused experts' parameter, dropping the dense MLPs'
    # and shared experts' adapters. The oracle names its targets itself: that conversion is off here.
    with mock.patch("peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers"):
        model = get_peft_model(copy.deepcopy(hf), peft_config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return model


def _peft_adapters(model):
    """(HF module path, parameter name or None for a linear, lora_A weight, lora_B weight) per PEFT adapter."""
    for path, module in model.named_modules():
        if "default" not in getattr(module, "lora_A", {}):
            continue
        base = re.sub(r"(\.base_layer)+$", "", path.removeprefix("base_model.model."))
        yield base, getattr(module, "parameter_name", None), module.lora_A["default"].weight, \
            module.lora_B["default"].weight


def _base_parameter(model, base: str, name: str) -> torch.Tensor:
    module = model.get_submodule("base_model.model." + base)
    while not hasattr(module, name) or hasattr(module, "base_layer") and name not in module._parameters:
        module = module.base_layer
    return getattr(module, name)


def peft_lora_state(model, family, megamoe_config, grad: bool = False) -> dict[str, torch.Tensor]:
    """PEFT's adapters (or their gradients) under megamoe's logical adapter keys."""
    logical_of = {hf: logical for logical, hf in adapter_for(family).renames(megamoe_config).items()}
    out = {}
    for base, param_name, a, b in _peft_adapters(model):
        a, b = (a.grad, b.grad) if grad else (a.detach(), b.detach())
        if param_name is None or _base_parameter(model, base, param_name).dim() == 2:
            key = logical_of[f"{base}.{param_name or 'weight'}"]
            out[f"{key}.lora_A"], out[f"{key}.lora_B"] = a.clone(), b.clone()
            continue
        experts = _base_parameter(model, base, param_name).shape[0]
        rank = a.shape[0] // experts
        a_e = a.reshape(experts, rank, a.shape[-1])
        b_e = b.reshape(b.shape[0], rank, experts)
        for e in range(experts):
            if param_name == "down_proj":
                parts = (("down_proj", b_e[:, :, e]),)
            else:
                ffn = b.shape[0] // 2
                parts = (("gate_proj", b_e[:ffn, :, e]), ("up_proj", b_e[ffn:, :, e]))
            for proj, b_part in parts:
                key = logical_of[f"{base}.{e}.{proj}.weight"]
                out[f"{key}.lora_A"], out[f"{key}.lora_B"] = a_e[e].clone(), b_part.clone()
    return out


@torch.no_grad()
def lora_grad_state_dict(model, group=None) -> dict[str, torch.Tensor]:
    """megamoe's adapter gradients under the adapter keys (the parameters swapped with their gradients)."""
    params = lora_parameters(model)
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    try:
        return lora_state_dict(model, group)
    finally:
        for p, s in zip(params, saved):
            p.copy_(s)


def token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))


@torch.no_grad()
def random_adapters(model, seed: int = 0) -> dict[str, torch.Tensor]:
    """Give ``model``'s adapters random values (B too) and return them (:func:`lora_state_dict`, one process)."""
    g = torch.Generator().manual_seed(seed)
    for p in lora_parameters(model):
        p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return lora_state_dict(model)
