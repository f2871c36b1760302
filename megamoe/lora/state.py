"""Adapters as a state dict: ``lora_state_dict(model)`` and ``merge_lora(state_dict, lora_state, config)``.

Keys are ``<base parameter name>.lora_A`` / ``.lora_B``, the base parameter name being the one in the model's
full (logical) state dict, the names ``megamoe convert export-hf`` maps to HF keys: ``A`` [r, in], ``B``
[out, r] of each weight [out, in]. Routed experts have one entry per expert and HF weight
(``…experts.<e>.gate_proj.weight.lora_A``); gate and up share their ``A`` (one adapter over the fused
``gate_up``, PEFT's layout on Qwen3-MoE): the two ``lora_A`` entries are equal.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe import comms
from megamoe.checkpoint_state import LogicalChunk, sharded_state_dict
from megamoe.lora.config import LoRAConfig
from megamoe.models.hf_loading import copy_into_chunks

__all__ = ["lora_chunks", "lora_state_dict", "load_lora_state_dict", "merge_lora", "LORA_SUFFIXES"]

LORA_SUFFIXES = (".lora_A", ".lora_B")


def lora_chunks(model: nn.Module) -> list[LogicalChunk]:
    """This rank's logical chunks of the adapters (views), as the checkpoint stores them."""
    return [c for c in sharded_state_dict(model) if c.name.endswith(LORA_SUFFIXES)]


@torch.no_grad()
def lora_state_dict(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """The full adapters of ``model`` (CPU tensors, sorted by key). One process: ``group=None``. Sharded over
    TP / EP / PP: pass the group spanning them (e.g. the world); every rank of it calls this and gets the whole
    dict (each element comes from a rank that holds it). ValueError when a tensor is not whole here."""
    chunks = lora_chunks(model)
    shapes = {c.name: (c.global_shape, c.tensor.dtype) for c in chunks}
    if comms.group_size(group) > 1:
        for other in comms.all_gather_object(sorted((n, s, str(d)) for n, (s, d) in shapes.items()), group):
            for name, shape, dtype in other:
                shapes.setdefault(name, (tuple(shape), getattr(torch, dtype.removeprefix("torch."))))
    device = chunks[0].tensor.device if chunks else torch.device("cpu")
    full = {name: torch.full(shape, float("-inf"), dtype=dtype, device=device)
            for name, (shape, dtype) in sorted(shapes.items())}
    for c in chunks:
        region = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape))
        full[c.name][region] = c.tensor
    if comms.group_size(group) > 1:
        for tensor in full.values():
            comms.all_reduce_(tensor, group, op=torch.distributed.ReduceOp.MAX)
    for name, tensor in full.items():
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"lora_state_dict: {name} is not whole on this rank (sharded, or not finite): pass the "
                             "group its shards span")
    return {name: tensor.cpu() for name, tensor in full.items()}


def load_lora_state_dict(model: nn.Module, lora_state: dict[str, torch.Tensor]) -> None:
    """Copy the full adapters ``lora_state`` (keys as :func:`lora_state_dict`'s) into ``model``'s adapters,
    each rank its shards. ValueError naming the first adapter missing, unknown (an adapter of a weight the model
    does not adapt, from this rank's layers) or misshapen."""
    grouped: dict[str, list[LogicalChunk]] = {}
    for chunk in lora_chunks(model):
        grouped.setdefault(chunk.name, []).append(chunk)
    missing = sorted(set(grouped) - set(lora_state))
    if missing:
        raise ValueError(f"load_lora_state_dict: {len(missing)} adapters of the model are missing, e.g. {missing[0]}")
    for name, chunks in grouped.items():
        copy_into_chunks(name, chunks, lora_state[name])


def merge_lora(state_dict: dict[str, torch.Tensor], lora_state: dict[str, torch.Tensor],
               config: LoRAConfig) -> dict[str, torch.Tensor]:
    """A new state dict: ``state_dict`` (megamoe logical names and layout) with every adapted weight replaced by
    ``W + scaling * B @ A`` (computed in fp32 or wider, cast back to ``W``'s dtype). ValueError naming the key
    when an adapter has no base weight, lacks its other half, or the shapes disagree; a kept FP8 weight must be
    dequantized first (its merge would be requantized)."""
    bases = sorted({k[:-len(".lora_A")] for k in lora_state if k.endswith(LORA_SUFFIXES)})
    stray = [k for k in lora_state if not k.endswith(LORA_SUFFIXES)]
    if stray:
        raise ValueError(f"merge_lora: {stray[0]} is not an adapter key (<weight>.lora_A / .lora_B)")
    merged = dict(state_dict)
    for base in bases:
        a, b = lora_state.get(base + ".lora_A"), lora_state.get(base + ".lora_B")
        if a is None or b is None:
            raise ValueError(f"merge_lora: {base} has {'lora_B' if a is None else 'lora_A'} but not "
                             f"{'lora_A' if a is None else 'lora_B'}")
        if base not in state_dict:
            raise ValueError(f"merge_lora: the adapter {base}.lora_A has no base weight {base} in the state dict")
        weight = state_dict[base]
        if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"merge_lora: {base} is a kept FP8 weight; dequantize it first (merging into FP8 "
                             "would round the adapters away)")
        if (a.dim(), b.dim()) != (2, 2) or a.shape[0] != config.rank or b.shape[1] != config.rank or \
                tuple(weight.shape) != (b.shape[0], a.shape[1]):
            raise ValueError(f"merge_lora: {base} is {tuple(weight.shape)} but its adapter is B {tuple(b.shape)} @ "
                             f"A {tuple(a.shape)} (rank {config.rank})")
        wide = torch.promote_types(weight.dtype, torch.float32)
        delta = b.to(weight.device, wide) @ a.to(weight.device, wide)
        merged[base] = (weight.to(wide) + config.scaling * delta).to(weight.dtype)
    return merged
