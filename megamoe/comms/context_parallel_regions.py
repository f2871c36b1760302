"""Autograd function of context parallelism: the all-gather of attention's keys and values (or
MLA's compressed latents) over the CP group, whose ranks hold different tokens of the same sequences.

Forward: each rank's [..., S / cp, ...] block is all-gathered along ``dim`` in rank order (the caller
restores sequence order from the load-balanced chunk layout, :mod:`megamoe.transformer.context_parallel`).
Backward: every CP rank's queries attended to every rank's keys, so the gradient of this rank's keys is
the SUM of all ranks' gradients of its block: one reduce-scatter (sum) along ``dim``.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from megamoe.comms.collectives import _reduce_scatter_uneven_dim0, all_gather_into
from megamoe.comms.groups import group_size

__all__ = ["gather_from_context_parallel_region"]


class _GatherFromCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_into(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = _reduce_scatter_uneven_dim0(grad.movedim(ctx.dim, 0), ctx.group, None).movedim(0, ctx.dim)
        return grad.contiguous(), None, None


def gather_from_context_parallel_region(x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """Forward: all-gather ``x`` along ``dim`` over the CP ``group`` (rank order; the result is
    ``cp`` times longer along ``dim``). Backward: reduce-scatter (sum) of the gradient along ``dim``,
    each rank keeping its own block. Recorded by the comm counter as ``all_gather`` (forward) and
    ``reduce_scatter`` (backward) on the CP group. ``group=None`` (one rank): the identity."""
    if group_size(group) == 1:
        return x
    return _GatherFromCP.apply(x, group, dim % x.dim())
