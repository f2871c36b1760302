"""Where a parameter's accumulated gradient lives: ``param.main_grad`` or ``param.grad``.

Parameters that are not fp32 (bf16, fp16) trained by the
:class:`~megamoe.training.distributed_optimizer.DistributedOptimizer` accumulate their gradient over
micro-batches in fp32: a post-accumulate-grad hook adds each micro-batch's gradient (autograd's
``p.grad``, in the parameter dtype) into ``param.main_grad``, an fp32 tensor of the parameter's shape (a
view of the optimizer's per-bucket buffer), and sets ``p.grad = None`` at once. Every reader of
gradients (the gradient sync's TP / tied / expert replica sums, the optimizer's reduction, the norm and
clipping, the non-finite search, the memory measurement) goes through :func:`main_grad`, so fp32
parameters, which have no ``main_grad``, are read exactly as before (``p.grad``).

Low-level on purpose: :mod:`megamoe.moe` and :mod:`megamoe.tensor_parallel` read it without importing
:mod:`megamoe.training`.
"""

from __future__ import annotations

import torch

__all__ = ["main_grad", "gradients"]


def main_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient to read, reduce and clip in place: ``param.main_grad`` (fp32, shaped like ``param``)
    while one is held, else ``param.grad`` (None before any backward)."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def gradients(params) -> list[torch.Tensor]:
    """:func:`main_grad` of each of ``params`` that has one (in order)."""
    return [g for g in (main_grad(p) for p in params) if g is not None]
