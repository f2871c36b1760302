"""The ``loop`` expert backend: plain autograd over ``F.linear`` per slot, the reference the fused
backend is checked against (see :mod:`megamoe.moe.experts.grouped_experts`)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from megamoe.moe.experts.expert_activations import activate as _activate
from megamoe.transformer.recompute import checkpointed

__all__ = ["loop_mlp"]


def loop_mlp(tokens: torch.Tensor, gate_up_weights: Sequence[torch.Tensor],
             down_weights: Sequence[torch.Tensor], sizes: list[int], activation,
             recompute_activation: bool = False, gate_up_biases: Sequence[torch.Tensor] | None = None,
             down_biases: Sequence[torch.Tensor] | None = None, add_down_bias: bool = True) -> torch.Tensor:
    """Per-slot ``F.linear`` on ``split`` views (never ``weight[slot]`` indexing, whose backward
    materialises a zero-filled full-size gradient per slot), plain autograd; the activation recomputed
    in backward with ``recompute_activation``. Biases (gpt-oss): see :mod:`megamoe.moe.experts.grouped_experts`; the
    down bias is added where ``add_down_bias`` (ETP rank 0), its gradient reaching every rank's copy."""
    slots = len(sizes)
    gate_up_biases = gate_up_biases if gate_up_biases is not None else [None] * slots
    outputs = []
    for s, (rows, w_gate_up, w_down) in enumerate(zip(tokens.split(sizes), gate_up_weights, down_weights)):
        act = checkpointed(_activate, F.linear(rows, w_gate_up, gate_up_biases[s]), activation,
                           enabled=recompute_activation)
        out = F.linear(act, w_down)
        if down_biases is not None:
            out = out + _AddedOnce.apply(down_biases[s], add_down_bias)
        outputs.append(out)
    return torch.cat(outputs)


class _AddedOnce(torch.autograd.Function):
    """The down bias as this ETP rank adds it: itself on the adding rank, zeros elsewhere; the gradient
    reaches every rank's copy (see :mod:`megamoe.moe.experts.grouped_experts`)."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, adds: bool):
        return bias.clone() if adds else torch.zeros_like(bias)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
