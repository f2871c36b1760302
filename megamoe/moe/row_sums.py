"""Summing rows into the tokens they belong to: the MoE combine's reductions, in fp32, in a fixed order on demand.

The combine adds each token's rows (its pairs' weighted expert outputs, or the partial sums returned by the
EP ranks its pairs went to); the backward of a row gather does the same with the rows' gradients.
``index_add_`` does it in one call, but on CUDA with atomics, whose order varies from run to run, and in the
rows' dtype: bf16 rows would be summed in bf16. Here:

- the sum is accumulated in fp32 (or wider) and the caller rounds it once;
- the deterministic mode (``MoEConfig.deterministic``, or torch's ``torch.use_deterministic_algorithms(True)``)
  replaces the scatter by gathers: a table lists each token's rows in row order, and column c of it is added
  to every token at once, c = 0, 1, ...: no atomics, the same order on every run and device. That is the
  order of ``index_add_`` on the CPU (rows one after another), so on the CPU both modes are bit-identical.
"""

from __future__ import annotations

import torch

__all__ = ["sum_rows", "gather_rows", "uses_deterministic_sums"]


def uses_deterministic_sums(requested: bool) -> bool:
    """The deterministic mode: asked for (``MoEConfig.deterministic``) or torch's deterministic algorithms on."""
    return requested or torch.are_deterministic_algorithms_enabled()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _row_table(index: torch.Tensor, num_out: int, max_per_out: int) -> torch.Tensor:
    """[num_out, max_per_out]: the rows of each output in row order, padded with N (a zero row)."""
    num_rows = index.shape[0]
    order = torch.argsort(index, stable=True)
    sorted_index = index[order]
    column = torch.empty_like(index)
    column[order] = torch.arange(num_rows, device=index.device) - torch.searchsorted(sorted_index, sorted_index)
    table = torch.full((num_out * max_per_out,), num_rows, dtype=torch.int64, device=index.device)
    table.index_copy_(0, index * max_per_out + column, torch.arange(num_rows, device=index.device))
    return table.view(num_out, max_per_out)


def _sum(rows: torch.Tensor, index: torch.Tensor, num_out: int, max_per_out: int, deterministic: bool):
    acc_dtype = _accumulation_dtype(rows.dtype)
    out = rows.new_zeros(num_out, rows.shape[1], dtype=acc_dtype)
    if not uses_deterministic_sums(deterministic):
        return out.index_add_(0, index, rows.to(acc_dtype))
    table = _row_table(index, num_out, max_per_out)
    padded = torch.cat([rows.to(acc_dtype), out.new_zeros(1, rows.shape[1])])
    for column in range(max_per_out):
        out += padded.index_select(0, table[:, column])
    return out


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, index, num_out, max_per_out, deterministic):
        ctx.save_for_backward(index)
        ctx.rows_dtype = rows.dtype
        return _sum(rows, index, num_out, max_per_out, deterministic)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        index, = ctx.saved_tensors
        return grad_out.index_select(0, index).to(ctx.rows_dtype), None, None, None, None


def sum_rows(rows: torch.Tensor, index: torch.Tensor, num_out: int, *, max_per_out: int,
             deterministic: bool = False) -> torch.Tensor:
    """``out[t] = sum of rows[i] over the rows with index[i] = t``: rows [N, H], index [N] int64 in
    ``[0, num_out)``, at most ``max_per_out`` rows per output -> [num_out, H] in fp32 (or wider: the caller
    rounds once). Gradients flow to ``rows`` (a gather). ``deterministic``: see the module docstring."""
    if rows.dim() != 2 or index.shape != rows.shape[:1]:
        raise ValueError(f"rows must be [N, H] with index [N], got {tuple(rows.shape)} and {tuple(index.shape)}")
    return _SumRows.apply(rows, index, num_out, max_per_out, deterministic)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, index, max_per_row, deterministic):
        ctx.save_for_backward(index)
        ctx.num_values, ctx.max_per_row, ctx.deterministic = values.shape[0], max_per_row, deterministic
        return values.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        index, = ctx.saved_tensors
        grad = _sum(grad_rows, index, ctx.num_values, ctx.max_per_row, ctx.deterministic)
        return grad.to(grad_rows.dtype), None, None, None


def gather_rows(values: torch.Tensor, index: torch.Tensor, *, max_per_row: int,
                deterministic: bool = False) -> torch.Tensor:
    """``values.index_select(0, index)`` (values [T, H], index [N]) whose backward sums the N row gradients
    into [T, H] as :func:`sum_rows` does (fp32, rounded once; deterministic on demand); each value is taken
    at most ``max_per_row`` times."""
    if not torch.is_grad_enabled() or not values.requires_grad:
        return values.index_select(0, index)
    return _GatherRows.apply(values, index, max_per_row, deterministic)
