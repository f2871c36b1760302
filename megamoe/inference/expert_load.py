"""Expert-load statistics gathered during inference, for rebalancing expert placements.

Every :class:`~megamoe.moe.moe_layer.MoELayer` counts the (token, expert) pairs its router selects
on this rank (``load_counter.per_expert``). :func:`gather_expert_load` totals them for the whole
model: each pipeline stage contributes its own layers, and under data-parallel attention the
data-parallel ranks (which served different requests) are summed; TP ranks and replicated
data-parallel ranks saw the same tokens and are counted once. The result is what
:func:`~megamoe.moe.placement.expert_slots.save_expert_load` writes and ``megamoe-convert import-hf / reshard
--expert-load FILE`` reads to build balanced placements (:meth:`ExpertPlacement.balanced`).
"""

from __future__ import annotations

import torch

from megamoe import comms
from megamoe.models.gpt_moe import GPTMoEModel

__all__ = ["gather_expert_load", "reset_expert_load"]


def reset_expert_load(model: GPTMoEModel) -> None:
    """Zero this stage's expert-load counters (e.g. before generation, after a warm-up)."""
    for layer in model.moe_layers().values():
        layer.load_counter.reset()


@torch.no_grad()
def gather_expert_load(model: GPTMoEModel, state, *, data_parallel_attention: bool) -> dict[int, torch.Tensor]:
    """Per-layer token counts per expert for every MoE layer of the model: ``{layer id: [E] int64}``
    on CPU, identical on every rank. Collective over the pipeline group (and the data-parallel group
    when ``data_parallel_attention``: each DP rank served its own requests)."""
    layer_ids = model.config.moe_layer_ids
    if not layer_ids:
        raise ValueError("the model has no MoE layer: there is no expert load to gather")
    local = model.moe_layers()
    device = next(model.parameters()).device
    counts = torch.zeros(len(layer_ids), model.config.moe.num_experts, dtype=torch.int64, device=device)
    for row, layer_id in enumerate(layer_ids):
        if layer_id in local:
            counts[row] = local[layer_id].load_counter.per_expert.to(device)
    comms.all_reduce_(counts, state.pp.group)                  # each layer lives on one stage
    if data_parallel_attention:
        comms.all_reduce_(counts, state.dp.group)
    return {layer_id: counts[row].cpu() for row, layer_id in enumerate(layer_ids)}
