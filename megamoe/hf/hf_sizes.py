"""The sizes a HuggingFace config.json and a target layout ask for, checked before anything is built.

config.json is untrusted input, and the model, the expert placements and the layout plan are all built
from its sizes: a ``hidden_size`` of 1e9 or a ``vocab_size`` of 1e12 asks the allocator for terabytes,
1e6 layers or experts loop for hours. The weight files' headers (read when the directory is opened)
already say how large the model is, so config.json is checked against them first, cheaply and naming the
field; the adapter's dry run then checks every shape (:func:`megamoe.hf.import_hf.plan_hf_conversion`).

Sizes of the layout are checked before the plan walks its ranks: the TP size against the heads (every
TP rank holds whole heads), the PP size against the layers (a TP or PP size of 1e6 would otherwise be
found only after building the rank groups of a world of 1e6), and the expert slots against this
machine's memory (each EP rank holds ``slots / ep`` experts of every MoE layer of its stage, replicas
included; the checkpoint stores each expert once, but no rank could load it).
"""

from __future__ import annotations

import math
import os
import re

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.hf_checkpoint import HFTensorInfo
from megamoe.checkpoint.layout import ParallelLayout
from megamoe.models import GPTMoEConfig
from megamoe.pipeline.partition import partition_layers

__all__ = ["check_sizes_against_weights", "check_layout_sizes", "machine_memory_bytes"]

_EMBEDDING = "model.embed_tokens.weight"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")             # routed experts stored one by one
_FUSED_EXPERTS = re.compile(r"\.experts\.[A-Za-z_]")     # stored stacked: [num_experts, ...]
_EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
_GIB = 2**30


def _experts_held(tensors: dict[str, HFTensorInfo]) -> int:
    """The most routed experts any layer of the files holds (0 when none is stored)."""
    held = 0
    for key, info in tensors.items():
        match = _EXPERT.search(key)
        if match:
            held = max(held, int(match.group(1)) + 1)
        elif _FUSED_EXPERTS.search(key) and info.shape:
            held = max(held, info.shape[0])
    return held


def check_sizes_against_weights(config: GPTMoEConfig, hf_config: dict, tensors: dict[str, HFTensorInfo],
                                where: str) -> None:
    """ConversionError naming the config.json field whose size the weight files (their headers:
    ``tensors``) do not hold: ``vocab_size`` and ``hidden_size`` against the embedding, the layers, the
    routed experts. Costs one pass over the tensor names."""
    embedding = tensors.get(_EMBEDDING)
    if embedding is not None and len(embedding.shape) == 2:
        for field, size, held in (("vocab_size", config.vocab_size, embedding.shape[0]),
                                  ("hidden_size", config.hidden_size, embedding.shape[1])):
            if size != held:
                raise ConversionError(f"{where}: {field} is {size}, but {_EMBEDDING} in {embedding.file} has "
                                      f"{held} (shape {list(embedding.shape)}); fix config.json")
    layers = {int(m.group(1)) for m in map(_LAYER.match, tensors) if m}
    needed = config.num_layers + config.mtp_num_layers
    if needed > len(layers):
        mtp = f" + {config.mtp_num_layers} MTP layers" if config.mtp_num_layers else ""
        raise ConversionError(f"{where}: num_hidden_layers is {config.num_layers}{mtp}, but the weight files hold "
                              f"{len(layers)} layers (model.layers.N.*); fix config.json")
    if config.moe is not None:
        experts, held = config.moe.router.num_experts, _experts_held(tensors)
        if experts > held:
            field = next((f for f in _EXPERT_COUNT_FIELDS if f in hf_config), "num_experts")
            raise ConversionError(f"{where}: {field} is {experts}, but the weight files hold {held} routed experts "
                                  "per layer; fix config.json")


def machine_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_layout_sizes(config: GPTMoEConfig, layout: ParallelLayout) -> None:
    """ConversionError, before any rank of ``layout`` is planned, for a TP size that does not divide the
    attention heads, a PP size that leaves a stage without layers, and expert slots whose weights alone
    exceed this machine's memory on one EP rank (a lower bound: bf16 weights, and ceil(MoE layers / pp)
    layers, which some stage holds at least)."""
    heads = config.attention.num_attention_heads
    if heads % layout.tp:
        raise ConversionError(f"layout {layout} is impossible for this model: --tp {layout.tp} must divide the "
                              f"{heads} attention heads (each TP rank holds whole heads)")
    try:
        partition_layers(config.num_layers, layout.pp)      # the model's own split of its layers over --pp
    except ValueError as e:
        raise ConversionError(f"layout {layout} is impossible for this model: {e}") from None
    if config.moe is None:
        return
    num_expert_slots = config.moe.num_expert_slots
    per_expert = (3 if config.moe.activation.startswith("swiglu") else 2) * config.hidden_size * \
        config.moe.ffn_hidden_size // layout.etp
    layers = math.ceil(len(config.moe_layer_ids) / layout.pp)
    need = num_expert_slots // layout.ep * per_expert * 2 * layers
    memory = machine_memory_bytes()
    if need > memory:
        raise ConversionError(
            f"--num-expert-slots {num_expert_slots}: each EP rank would hold {num_expert_slots // layout.ep} expert "
            f"slots of {layers} MoE layer(s), at least {need / _GIB:.1f} GiB of expert weights (bf16), more than this "
            f"machine's memory ({memory / _GIB:.1f} GiB); use fewer slots (the model has "
            f"{config.moe.router.num_experts} experts) or a larger --ep")
