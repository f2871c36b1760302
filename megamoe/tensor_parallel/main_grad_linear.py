"""``F.linear`` whose weight gradient is added straight into the weight's fp32 ``main_grad`` (:func:`linear`).

bf16 parameters trained with fp32 master weights accumulate their gradient in ``p.main_grad``
(:mod:`megamoe.gradients`). Through ``F.linear``, autograd makes a bf16 weight gradient, hands it to the
accumulation hook, which adds it into ``main_grad`` and frees it. Here the backward's weight-gradient GEMM adds
into ``main_grad`` itself (:func:`megamoe.gradients.add_matmul_`: one GEMM with fp32 output where the device has
one; on CPU the bf16 GEMM, then one add) and returns None for the weight, so the hook has nothing to add. The
input and bias gradients, and the GEMMs' values, are ``F.linear``'s (the same GEMM calls: bit for bit).
Weights without a ``main_grad`` (fp32 parameters, a dequantized or adapted weight), inputs of another dtype and
autocast regions take ``F.linear`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe.gradients import add_matmul_, main_grad_target
from megamoe.precision import active_autocast_dtype

__all__ = ["linear"]


class _LinearIntoMainGrad(torch.autograd.Function):
    """``y = x W^T + b``; backward: ``dx = dy W``, ``main_grad(W) += dy^T x``, ``db = sum(dy)``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = None
        if ctx.needs_input_grad[1]:
            target = main_grad_target(weight)
            if target is None:          # the optimizer went away between forward and backward
                grad_weight = rows.t().mm(x.reshape(-1, x.shape[-1]))
            else:
                add_matmul_(target, rows.t(), x.reshape(-1, x.shape[-1]))
        grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; under autograd, for a weight that accumulates in an fp32 ``main_grad``,
    one node whose backward adds the weight gradient there (see the module docstring)."""
    if (getattr(weight, "main_grad_provider", None) is None or not torch.is_grad_enabled()
            or not weight.requires_grad or x.dtype != weight.dtype or active_autocast_dtype(x.device.type)):
        return F.linear(x, weight, bias)        # (under autocast, F.linear casts its operands itself)
    return _LinearIntoMainGrad.apply(x, weight, bias)
