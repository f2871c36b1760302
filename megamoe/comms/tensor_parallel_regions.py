"""Autograd functions of tensor parallelism: copy to / reduce from / scatter to / gather from a
tensor-parallel region, along the LAST dim."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from megamoe.comms.collectives import all_gather_into, all_reduce_
from megamoe.comms.groups import group_rank, group_size


def _split_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world, rank = group_size(group), group_rank(group)
    if x.shape[-1] % world:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_into(grad, ctx.group, dim=-1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_into(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce (sum) of the gradient over ``group``.

    Entry of a column-parallel layer: every TP rank consumes the full input, so the input's gradient
    is the sum of the per-rank partial gradients.
    """
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-reduce (sum) over ``group``. Backward: identity.

    Exit of a row-parallel layer: the per-rank partial products are summed.
    """
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-gather the last dim (rank order). Backward: keep this rank's chunk of the gradient."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)
