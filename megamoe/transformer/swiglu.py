"""SwiGLU, ``silu(gate) * up``, as one autograd node that saves only its inputs (:class:`SwiGLUFunction`).

Autograd's graph of ``F.silu(gate) * up`` keeps ``silu(gate)`` beside ``gate`` and ``up`` (one more [N, F]
tensor per layer) and runs three nodes; this node keeps the inputs, recomputes ``silu(gate)`` in backward
and writes ``d up = grad * silu(gate)``, ``d gate = silu'(gate) * grad * up`` with the same kernels
autograd calls (``silu_backward``), so its values are autograd's bit for bit in every dtype. The dense MLP
and the shared experts run it on bf16 / fp16 rows (:func:`swiglu`); fp32 rows keep the autograd form,
the oracle tests' path. (The routed experts' fused MLP has its own hand-written backward:
:mod:`megamoe.moe.experts.expert_activations`.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["SwiGLUFunction", "swiglu"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


class SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up`` (same shapes); saves ``gate`` and ``up``, recomputes ``silu(gate)`` backward."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: :class:`SwiGLUFunction` for bf16 / fp16 rows under autograd, else the plain ops."""
    if gate.dtype in _LOW_PRECISION and torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return SwiGLUFunction.apply(gate, up)
    return F.silu(gate) * up
