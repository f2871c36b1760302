"""Per-layer expert loads over a sliding window of steps (training) or forward passes (inference).

The statistics online expert rebalancing (:mod:`megamoe.moe.placement.eplb`) re-places experts from. The window is
a fixed-size ring buffer ``[window, layers, num_experts]`` of int64 token counts ON THE DEVICE of the
model: recording a step is one device copy into the next row, with no collective and no host sync
(the row index is a host counter). The reduction over ranks happens once per rebalance, by the
rebalancer; int64 counts make that sum exact, so every rank sees bit-identical loads.
"""

from __future__ import annotations

import torch

from megamoe.moe.placement.argument_checks import positive_int

__all__ = ["ExpertLoadWindow"]


class ExpertLoadWindow:
    """The last ``window`` recorded loads of ``num_layers`` layers (this rank's), ``num_experts`` each."""

    def __init__(self, window: int, num_layers: int, num_experts: int, device=None):
        self.window = positive_int(window, "window")
        self.num_layers = int(num_layers)
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {num_layers}")
        self.num_experts = positive_int(num_experts, "num_experts")
        self.buffer = torch.zeros(self.window, self.num_layers, self.num_experts, dtype=torch.int64, device=device)
        self.recorded = 0           # rows written since construction / reset (a host counter: no sync)

    @torch.no_grad()
    def record(self, loads: torch.Tensor) -> None:
        """Record one step's token counts ``loads`` [num_layers, num_experts] (integers), overwriting the
        oldest row once the window is full."""
        if tuple(loads.shape) != (self.num_layers, self.num_experts):
            raise ValueError(f"loads must be [num_layers, num_experts] = [{self.num_layers}, {self.num_experts}], "
                             f"got shape {tuple(loads.shape)}")
        if loads.is_floating_point() or loads.is_complex() or loads.dtype == torch.bool:
            raise ValueError(f"loads must be integer token counts, got dtype {loads.dtype}")
        self.buffer[self.recorded % self.window].copy_(loads)
        self.recorded += 1

    def total(self) -> torch.Tensor:
        """[num_layers, num_experts] int64: the sum over the window's rows (rows never written are zero),
        on the buffer's device."""
        return self.buffer.sum(dim=0)

    @property
    def filled(self) -> int:
        """How many rows hold a recorded step (at most ``window``)."""
        return min(self.recorded, self.window)

    def reset(self) -> None:
        self.buffer.zero_()
        self.recorded = 0
