"""Per-MoE-layer step metrics: each layer's aux loss, balancedness and expert load.

The model returns the SUM of its layers' aux losses; :class:`PerLayerAuxLoss` keeps each layer's own
share by hooking the layers' outputs (``MoELayer.forward -> (output, aux_loss)``) for the duration of
a step only, so inference and compiled decoding never run the hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megamoe.transformer.recompute import is_recomputing

__all__ = ["MoELayerMetrics", "PerLayerAuxLoss"]


@dataclass
class MoELayerMetrics:
    """One MoE layer's statistics over a step's global batch."""

    aux_loss: float                  # its (coefficient-weighted) aux loss: mean over micro-batches and DP
    balancedness: float              # mean / max EP-rank load under its placement (1.0: perfect)
    tokens_per_expert: list[int]     # routed (token, expert) pairs per expert, summed over all ranks


class PerLayerAuxLoss:
    """``with PerLayerAuxLoss(moe_layers) as recorder:`` sums each layer's aux loss over the forwards
    run inside (detached, fp64, on their device); ``recorder.totals(num_layers, device)`` is a
    [num_layers] tensor of them on ``device`` (zero for the layers of other stages or dense layers)."""

    def __init__(self, moe_layers: dict[int, nn.Module]):
        self._layers = moe_layers
        self._sums: dict[int, torch.Tensor] = {}
        self._handles = []

    def __enter__(self) -> PerLayerAuxLoss:
        for layer_id, layer in self._layers.items():
            self._handles.append(layer.register_forward_hook(self._hook(layer_id)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer_id: int):
        def record(module, inputs, output) -> None:
            if is_recomputing():     # a recomputed layer (activation recomputation) ran this forward already
                return
            aux = output[1].detach().double()         # stays on its device: no sync per layer
            self._sums[layer_id] = aux if layer_id not in self._sums else self._sums[layer_id] + aux
        return record

    def totals(self, num_layers: int, device: torch.device | str | None = None) -> torch.Tensor:
        out = torch.zeros(num_layers, dtype=torch.float64, device=device)
        for layer_id, total in self._sums.items():
            out[layer_id] = total
        return out
