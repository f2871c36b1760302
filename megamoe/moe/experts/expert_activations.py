"""The activations between the expert GEMMs, by name (``swiglu``, ``gelu``, ``relu``, ``silu``) or as a
:class:`~megamoe.moe.experts.clamped_swiglu.ClampedSwiGLU` (gpt-oss): the autograd form the reference and FP8
paths use, and the forward / hand-written backward of the fused expert MLP
(:class:`megamoe.moe.experts.grouped_experts.GroupedMLPFunction`). Gated activations take the gate half first."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe.moe.experts.clamped_swiglu import ClampedSwiGLU

__all__ = ["activate", "activation_forward", "activation_backward"]


def activate(hidden: torch.Tensor, activation) -> torch.Tensor:
    """Autograd activation of the gate(/up) projection output [n, G * F] -> [n, F]."""
    if isinstance(activation, ClampedSwiGLU):
        return activation.forward(hidden)
    if activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(hidden)
    if activation == "relu":
        return F.relu(hidden)
    return F.silu(hidden)


def activation_forward(hidden: torch.Tensor, activation) -> torch.Tensor:
    """[N, G * F] -> [N, F], one output allocation."""
    if isinstance(activation, ClampedSwiGLU):
        return activation.forward(hidden)
    if activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    if activation == "gelu":
        return F.gelu(hidden)
    if activation == "relu":
        return F.relu(hidden)
    return F.silu(hidden)


def activation_backward(grad_act: torch.Tensor, hidden: torch.Tensor, activation) -> torch.Tensor:
    """d(act)/d(hidden): grad_act [N, F], hidden [N, G * F] -> [N, G * F]. Consumes ``grad_act``
    (reused as scratch)."""
    if isinstance(activation, ClampedSwiGLU):
        return activation.backward(grad_act, hidden)
    aten = torch.ops.aten
    if activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        grad_hidden = torch.empty_like(hidden)
        grad_gate, grad_up = grad_hidden.chunk(2, dim=-1)
        torch.mul(grad_act, F.silu(gate), out=grad_up)                  # d up = da * silu(g)
        aten.silu_backward.grad_input(grad_act.mul_(up), gate, grad_input=grad_gate)  # d g = da * u * silu'(g)
        return grad_hidden
    if activation == "gelu":
        return aten.gelu_backward.grad_input(grad_act, hidden, grad_input=grad_act)
    if activation == "relu":
        return aten.threshold_backward.grad_input(grad_act, hidden, 0, grad_input=grad_act)
    return aten.silu_backward.grad_input(grad_act, hidden, grad_input=grad_act)
