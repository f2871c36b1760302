"""Expert placements for a conversion: default, kept from a checkpoint, or balanced from a load file."""

from __future__ import annotations

import logging
import os

from megamoe.checkpoint.errors import ConversionError
from megamoe.models import GPTMoEConfig
from megamoe.moe.placement.expert_load_file import load_expert_load
from megamoe.moe.placement.expert_slots import ExpertPlacement

__all__ = ["build_placements"]

logger = logging.getLogger(__name__)


def build_placements(config: GPTMoEConfig, ep: int, *, expert_load: str | os.PathLike | None = None,
                     saved: dict[int, ExpertPlacement] | None = None) -> dict[int, ExpertPlacement]:
    """The placement of every MoE layer of ``config`` over ``ep`` EP ranks and
    ``config.moe.num_expert_slots`` slots.

    With ``expert_load`` (a file written by :func:`megamoe.moe.placement.expert_slots.save_expert_load`, one load
    per MoE layer): :meth:`ExpertPlacement.balanced`. Otherwise the ``saved`` placement of a layer when it
    has the same slots and EP size (a resharded checkpoint keeps a rebalanced placement), else
    :meth:`ExpertPlacement.default`.
    """
    if config.moe is None:
        if expert_load is not None:
            raise ConversionError("--expert-load was given but the model has no MoE layers")
        return {}
    num_experts, num_slots = config.moe.num_experts, config.moe.num_expert_slots
    if num_slots % ep:
        raise ConversionError(f"{num_slots} expert slots cannot be divided evenly over EP {ep}: choose "
                              f"--num-expert-slots as a multiple of {ep} (>= {num_experts})")
    if expert_load is not None:
        try:
            loads = load_expert_load(expert_load)
        except (OSError, ValueError) as e:
            raise ConversionError(f"cannot use the expert-load file: {e}") from None
        layers = set(config.moe_layer_ids)
        if set(loads) != layers:
            raise ConversionError(
                f"{expert_load} has loads for layers {sorted(loads)}, the model's MoE layers are {sorted(layers)}; "
                "the file must give one load per MoE layer")
        placements = {}
        for layer, load in loads.items():
            if load.numel() != num_experts:
                raise ConversionError(f"{expert_load}: layer {layer} has loads for {load.numel()} experts, the model "
                                      f"has {num_experts}")
            placements[layer] = ExpertPlacement.balanced(load, num_slots, ep)
            logger.info("layer %d: balanced placement %r (balancedness %.3f)", layer, placements[layer],
                        placements[layer].balancedness(load))
        return placements
    placements = {}
    for layer in config.moe_layer_ids:
        kept = (saved or {}).get(layer)
        if kept is not None and (kept.num_experts, kept.num_slots, kept.ep_size) == (num_experts, num_slots, ep):
            placements[layer] = kept
        else:
            placements[layer] = ExpertPlacement.default(num_experts, num_slots, ep)
    return placements
