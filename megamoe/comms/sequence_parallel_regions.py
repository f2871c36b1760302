"""Autograd functions of sequence parallelism: scatter to / gather from / reduce-scatter to a
sequence-parallel region along the FIRST dim (or the ``dim`` given; uneven ``sizes`` allowed), and the
fused all-gather + column-parallel projections entering a sequence-parallel block."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from megamoe.comms.collectives import _reduce_scatter_uneven_dim0, all_gather_into
from megamoe.comms.groups import group_rank, group_size


def _split_first(x: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None = None) -> torch.Tensor:
    world, rank = group_size(group), group_rank(group)
    if sizes is not None:
        return x[sum(sizes[:rank]):sum(sizes[:rank + 1])].contiguous()
    if x.shape[0] % world:
        raise ValueError(f"first dim {x.shape[0]} is not divisible by the sequence-parallel size {world}")
    return x.chunk(world, dim=0)[rank].contiguous()


def _split_seq(x: torch.Tensor, group: ProcessGroup, dim: int, sizes: Sequence[int] | None = None) -> torch.Tensor:
    return _split_first(x.movedim(dim, 0), group, sizes).movedim(0, dim).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup, dim: int, sizes: Sequence[int] | None) -> torch.Tensor:
    return _reduce_scatter_uneven_dim0(x.movedim(dim, 0), group, sizes).movedim(0, dim).contiguous()


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_seq(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_into(grad, ctx.group, dim=ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_grad, sizes, dim):
        ctx.group, ctx.reduce_grad, ctx.sizes, ctx.dim = group, reduce_grad, sizes, dim
        return all_gather_into(x, group, dim=dim, sizes=sizes)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter_seq(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None, None
        return _split_seq(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes, dim):
        ctx.group, ctx.sizes, ctx.dim = group, sizes, dim
        return _reduce_scatter_seq(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_into(grad, ctx.group, dim=ctx.dim, sizes=ctx.sizes), None, None, None


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Forward: keep this rank's chunk of dim ``dim`` (default the first). Backward: all-gather that dim."""
    return x if group_size(group) == 1 else _ScatterToSP.apply(x, group, dim % x.dim())


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None, reduce_grad: bool = True, sizes: Sequence[int] | None = None,
    dim: int = 0,
) -> torch.Tensor:
    """Forward: all-gather dim ``dim`` (default the first; rank order). Backward: reduce-scatter the
    gradient along that dim.

    The reduce-scatter is right when every rank consumes the gathered tensor with *different*
    weights (column-parallel layer after sequence-parallel norm): the input gradient is the sum of
    all ranks' contributions to this rank's rows. With ``reduce_grad=False`` the backward only keeps
    this rank's rows (use when the consumers' gradients are already identical across ranks).
    ``sizes``: every rank's row count when they may differ (see the module docstring).
    ``dim=1``: the model's batch-first [B, S, H] hidden states under sequence parallelism (each rank
    holds a contiguous chunk of the sequence dim); the collective runs on the tensor with ``dim``
    moved first (one copy), so calls and bytes are those of the first-dim region.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSP.apply(x, group, reduce_grad, None if sizes is None else tuple(int(n) for n in sizes),
                               dim % x.dim())


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None,
                                               sizes: Sequence[int] | None = None, dim: int = 0) -> torch.Tensor:
    """Forward: reduce-scatter (sum) along dim ``dim`` (default the first). Backward: all-gather that dim.

    Exit of a row-parallel layer under sequence parallelism, and of an all-gather MoE layer whose
    input tokens are sharded across the group. ``sizes``: the rows each rank keeps when they may
    differ (``x`` has ``sum(sizes)`` rows; rank r keeps ``sizes[r]`` of them, in rank order).
    ``dim=1``: the model's [B, S, H] hidden states (see :func:`gather_from_sequence_parallel_region`).
    """
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSP.apply(x, group, None if sizes is None else tuple(int(n) for n in sizes),
                                    dim % x.dim())


class _GatherLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, num, *weights_and_biases):
        weights, biases = weights_and_biases[:num], weights_and_biases[num:]
        full = all_gather_into(x, group, dim=dim)
        ctx.save_for_backward(x, *weights)             # the chunk, not the gathered input
        ctx.group, ctx.dim, ctx.has_bias = group, dim, [b is not None for b in biases]
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = all_gather_into(x, ctx.group, dim=ctx.dim)        # gathered again rather than kept
        flat = full.reshape(-1, full.shape[-1])
        grad_full, grad_weights, grad_biases = None, [], []
        for grad, weight, has_bias in zip(grads, weights, ctx.has_bias):
            if grad is None:
                grad_weights.append(None)
                grad_biases.append(None)
                continue
            grad = grad.reshape(-1, grad.shape[-1])
            part = grad @ weight.to(grad.dtype)                  # [N, in]
            grad_full = part if grad_full is None else grad_full + part
            grad_weights.append((grad.t() @ flat.to(grad.dtype)).to(weight.dtype))
            grad_biases.append(grad.sum(0).to(weight.dtype) if has_bias else None)
        grad_x = None
        if grad_full is not None:
            grad_x = _reduce_scatter_seq(grad_full.view(*full.shape[:-1], -1).to(x.dtype), ctx.group, ctx.dim, None)
        return (grad_x, None, None, None, *grad_weights, *grad_biases)


def gather_linears_from_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None, weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None], dim: int = 0,
) -> list[torch.Tensor]:
    """``[F.linear(full, w, b) for w, b in zip(weights, biases)]`` where ``full`` is ``x`` all-gathered
    along ``dim``: the column-parallel projections entering a sequence-parallel block (q, k, v; gate, up).

    Forward: one all-gather of ``x`` along ``dim``. Backward: the input gradient (the sum of every
    projection's) is reduce-scattered along ``dim``, as :func:`gather_from_sequence_parallel_region`
    does; but only the chunk ``x`` is kept for backward, and the weight gradients need the gathered
    input, so backward all-gathers ``x`` once more (Megatron-LM's sequence-parallel linear does the
    same): 1/tp of the block input's activation memory, for one more all-gather of ``x`` per block.
    Weight and bias gradients are complete locally. One rank (``group=None``): plain ``F.linear``.
    """
    if group_size(group) == 1:
        return [F.linear(x, w, b) for w, b in zip(weights, biases)]
    if len(weights) != len(biases):
        raise ValueError(f"gather_linears: {len(weights)} weights but {len(biases)} biases (None for none)")
    return list(_GatherLinears.apply(x, group, dim % x.dim(), len(weights), *weights, *biases))
