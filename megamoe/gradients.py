"""Where a parameter's accumulated gradient lives: ``param.main_grad`` or ``param.grad``.

Parameters that are not fp32 (bf16, fp16) trained by the
:class:`~megamoe.training.distributed_optimizer.DistributedOptimizer` accumulate their gradient over
micro-batches in fp32: a post-accumulate-grad hook adds each micro-batch's gradient (autograd's
``p.grad``, in the parameter dtype) into ``param.main_grad``, an fp32 tensor of the parameter's shape (a
view of the optimizer's per-bucket buffer), and sets ``p.grad = None`` at once. Every reader of
gradients (the gradient sync's TP / tied / expert replica sums, the optimizer's reduction, the norm and
clipping, the non-finite search, the memory measurement) goes through :func:`main_grad`, so fp32
parameters, which have no ``main_grad``, are read exactly as before (``p.grad``).

A backward may also add a weight's gradient straight into that fp32 buffer (:func:`main_grad_target`,
:func:`add_matmul_`), as the grouped experts (:class:`megamoe.moe.experts.grouped_mlp.GroupedMLPFunction`)
and the dense linears (:func:`megamoe.tensor_parallel.main_grad_linear.linear`) do, and return None for the
weight: autograd still runs the weight's accumulation node, so the post-accumulate hooks (the accumulation
hook, with ``p.grad`` None or another node's gradient, and the overlapped reduce-scatters) fire once per
backward as before, and a weight that other nodes also use gets their gradients through the hook.

Low-level on purpose: :mod:`megamoe.moe` and :mod:`megamoe.tensor_parallel` read it without importing
:mod:`megamoe.training`.
"""

from __future__ import annotations

import torch

__all__ = ["main_grad", "gradients", "main_grad_target", "add_matmul_"]


def main_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient to read, reduce and clip in place: ``param.main_grad`` (fp32, shaped like ``param``)
    while one is held, else ``param.grad`` (None before any backward)."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def gradients(params) -> list[torch.Tensor]:
    """:func:`main_grad` of each of ``params`` that has one (in order)."""
    return [g for g in (main_grad(p) for p in params) if g is not None]


def main_grad_target(param: torch.Tensor) -> torch.Tensor | None:
    """The fp32 ``main_grad`` a backward may add ``param``'s gradient into directly (allocated zeroed on the
    step's first use by its owner, the distributed optimizer, which sets ``param.main_grad_provider``), or
    None: the gradient goes through autograd (fp32 parameters, a cast weight, no such optimizer)."""
    provider = getattr(param, "main_grad_provider", None)
    return None if provider is None else provider()


def add_matmul_(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``target += a @ b`` in place (2-D, or batched 3-D), ``target`` fp32 and ``a`` / ``b`` in a lower
    precision: one GEMM with fp32 output accumulating into ``target`` where the device has one (CUDA:
    ``out_dtype``), else (CPU: no mixed-dtype GEMM kernels) the GEMM in ``a``'s dtype, then one add."""
    batched = a.dim() == 3
    if target.device.type == "cuda" and a.dtype != target.dtype:
        (torch.baddbmm if batched else torch.addmm)(target, a, b, out_dtype=target.dtype, out=target)
    elif a.dtype == target.dtype:
        (target.baddbmm_ if batched else target.addmm_)(a, b)
    else:
        target.add_(torch.bmm(a, b) if batched else torch.mm(a, b))
