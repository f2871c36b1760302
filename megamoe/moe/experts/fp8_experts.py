"""FP8 expert MLPs: the CPU emulation (the numerical reference), ``torch._scaled_grouped_mm`` and
TransformerEngine ``fp8_autocast``; used by :class:`megamoe.moe.experts.grouped_experts.GroupedExperts` when
``ExpertsConfig.fp8`` is set.

Every path computes, per slot and GEMM, ``Y = deq(Q(X)) deq(Q(W))^T`` where ``Q`` quantises with
the recipe's scales (:mod:`megamoe.moe.experts.fp8`); backward quantises the incoming gradient ``dY`` in
the gradient format and reuses the forward's quantised operands: ``dX = deq(Q(dY)) deq(Q(W))``,
``dW = deq(Q(dY))^T deq(Q(X))`` (straight-through: the fp32/bf16 master weight receives ``dW``).

- emulated (``backend="fp8_emulated"``, any device): quantise, dequantise, multiply in fp32.
- ``torch`` backend on sm90+: forward GEMMs in FP8 with ``torch._scaled_grouped_mm`` (e4m3 operands,
  per-row fp32 scales: one per token, one per weight output row; coarser recipes broadcast their
  scale to rows). Backward GEMMs run in bf16 (``torch._grouped_mm``) on the same dequantised
  operands the emulation uses: ``_scaled_grouped_mm`` takes e4m3 only (no e5m2 gradients), and in
  ``dW = dY^T X`` the token dimension is contracted, so per-token scales cannot be applied outside
  the GEMM.
- ``te`` backend: TE's ``GroupedLinear`` under ``fp8_autocast`` with the recipe from the config.

FP8 GEMM kernels want each group's row count to be a multiple of 16: every path pads each slot's
rows with zero rows (:class:`PaddedRows`) and drops them from the output. Zero rows have zero amax,
change no scale, add nothing to ``dW`` and their outputs are discarded, so padding never changes a
result (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megamoe.moe.experts.fp8 import (FP8AmaxReduction, FP8Config, FP8ScalingState, amax_rows, compute_scale, dequantize,
                                     quantize)
from megamoe.moe.experts.grouped_mlp import (SlotGroups, grouped_linear, grouped_linear_input_grad,
                                             grouped_linear_weight_grad)
from megamoe.transformer.recompute import forward_value, is_recomputing

__all__ = ["FP8_ROW_ALIGNMENT", "PaddedRows", "fp8_grouped_mlp", "te_fp8_grouped_mlp"]

FP8_ROW_ALIGNMENT = 16
_KERNELS = ("emulated", "scaled_grouped_mm")


@dataclass(frozen=True)
class PaddedRows:
    """Where each sorted row goes when every slot's rows are padded to a multiple of ``multiple``.

    ``exact`` sizes the padded buffer to the padded total (one host sync, needed for host-side
    split sizes); otherwise to the static bound ``N + S * (multiple - 1)`` with the tail unused.
    """

    counts: torch.Tensor           # [S] int64 rows per slot, unpadded
    slot_of_row: torch.Tensor      # [N] int64 slot of each sorted row
    destination: torch.Tensor      # [N] int64 row in the padded buffer
    padded_counts: torch.Tensor    # [S] int64, multiples of `multiple`
    padded_offsets: torch.Tensor   # [S] int32 cumulative padded row ends
    num_padded_rows: int

    @classmethod
    def build(cls, tokens_per_slot: torch.Tensor, num_rows: int, multiple: int, exact: bool) -> "PaddedRows":
        if multiple < 1:
            raise ValueError(f"padding multiple must be >= 1, got {multiple}")
        counts = tokens_per_slot.long()
        if exact and (int(counts.sum()) != num_rows or int(counts.min()) < 0):
            raise ValueError(f"tokens_per_slot {counts.tolist()} must be >= 0 and sum to the number of rows "
                             f"({num_rows})")
        num_slots = counts.shape[0]
        padded_counts = (counts + multiple - 1) // multiple * multiple
        starts = torch.cumsum(counts, 0) - counts
        padded_ends = torch.cumsum(padded_counts, 0)
        slot_of_row = torch.repeat_interleave(torch.arange(num_slots, device=counts.device), counts,
                                              output_size=num_rows)
        destination = (torch.arange(num_rows, device=counts.device) - starts[slot_of_row]
                       + (padded_ends - padded_counts)[slot_of_row])
        num_padded = int(padded_ends[-1]) if exact else num_rows + num_slots * (multiple - 1)
        return cls(counts, slot_of_row, destination, padded_counts, padded_ends.to(torch.int32), num_padded)

    def pad(self, rows: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[N, ...] -> [num_padded_rows, ...], padding rows = ``fill``. FP8 rows move as bytes
        (index_put has no FP8 kernels everywhere)."""
        if rows.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return self.pad(rows.view(torch.uint8)).view(rows.dtype)
        out = rows.new_full((self.num_padded_rows, *rows.shape[1:]), fill)
        out[self.destination] = rows
        return out

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded[self.destination]

    def slot_groups(self) -> SlotGroups:
        """The padded layout as per-slot ``torch.mm`` groups (the emulation multiplies in fp32, which
        the accelerator grouped kernels do not take)."""
        return SlotGroups.from_counts(self.padded_counts, self.num_padded_rows, use_grouped_mm=False)


# ---- scales per recipe ------------------------------------------------------------------------
def _row_scales(x: torch.Tensor, rows: PaddedRows, role: str, config: FP8Config,
                state: FP8ScalingState | None, reduction: FP8AmaxReduction) -> torch.Tensor:
    """Quantisation scale of each row of a token-major operand x [N, K] -> [N] fp32."""
    dtype = config.dtype_for(role)
    row_amax = amax_rows(x)
    if config.recipe == "rowwise":
        return compute_scale(reduction.row_amax(role, row_amax), dtype, config.margin)
    num_slots = rows.padded_counts.shape[0]
    slot_amax = row_amax.new_zeros(num_slots).scatter_reduce_(0, rows.slot_of_row, row_amax, "amax")
    return _slot_scales(slot_amax, role, config, state, reduction)[rows.slot_of_row]


def _weight_scales(weight: torch.Tensor, role: str, config: FP8Config,
                   state: FP8ScalingState | None, reduction: FP8AmaxReduction) -> torch.Tensor:
    """Quantisation scale of each output row of weight [S, O, K] -> [S, O] fp32."""
    dtype = config.dtype_for(role)
    row_amax = weight.detach().abs().amax(dim=2).float() if weight.shape[2] else weight.new_zeros(
        weight.shape[:2], dtype=torch.float32)
    if config.recipe == "rowwise":
        return compute_scale(reduction.row_amax(role, row_amax), dtype, config.margin)
    slot_amax = row_amax.amax(dim=1) if weight.shape[1] else row_amax.new_zeros(weight.shape[0])
    slot_scale = _slot_scales(slot_amax, role, config, state, reduction)
    return slot_scale[:, None].expand(weight.shape[:2]).contiguous()


def _slot_scales(slot_amax: torch.Tensor, role: str, config: FP8Config, state: FP8ScalingState | None,
                 reduction: FP8AmaxReduction) -> torch.Tensor:
    """[S] scales of a per-slot recipe from this batch's per-slot amaxes [S]: ``tensorwise`` scales by
    them; ``delayed`` scales by the history of earlier steps and records them (in training only, where
    the histories advance: no collective otherwise)."""
    if config.recipe == "tensorwise":
        return compute_scale(reduction.slot_amax(role, slot_amax, delayed=False), config.dtype_for(role),
                             config.margin)
    # From the history up to the previous step; a recomputed forward (activation recomputation) gets the
    # scale its original forward used, and records nothing: the step's amax is pushed once.
    slot_scale = forward_value(lambda: state.current_scale(role).clone())
    if state.training and not is_recomputing():
        state.record(role, reduction.slot_amax(role, slot_amax, delayed=True))
    return slot_scale


# ---- one grouped GEMM -------------------------------------------------------------------------
class FP8GroupedLinearFunction(torch.autograd.Function):
    """Per slot s: ``y_s = deq(Q(x_s)) deq(Q(w[s]))^T``; x [N, K], w [S, O, K] -> [N, O] in x's dtype.
    Saves the FP8 operands and their scales (not the high-precision ones) for backward."""

    @staticmethod
    def forward(ctx, x, weight, rows: PaddedRows, gemm: str, config: FP8Config, state, kernel: str,
                reduction: FP8AmaxReduction):
        x_scale = _row_scales(x, rows, f"{gemm}_input", config, state, reduction)      # [N]
        w_scale = _weight_scales(weight, f"{gemm}_weight", config, state, reduction)   # [S, O]
        x_q = quantize(x, x_scale[:, None], config.forward_dtype)
        w_q = quantize(weight, w_scale[:, :, None], config.forward_dtype)
        if kernel == "scaled_grouped_mm":
            # torch's scales multiply the FP8 values back (dequantisation), hence the reciprocals.
            out_padded = torch._scaled_grouped_mm(
                rows.pad(x_q), w_q.transpose(1, 2), scale_a=rows.pad(x_scale.reciprocal(), fill=1.0),
                scale_b=w_scale.reciprocal(), offs=rows.padded_offsets, out_dtype=torch.bfloat16)
        else:
            out_padded = grouped_linear(rows.pad(dequantize(x_q, x_scale[:, None])),
                                        dequantize(w_q, w_scale[:, :, None]), rows.slot_groups())
        ctx.save_for_backward(x_q, x_scale, w_q, w_scale)
        ctx.rows, ctx.gemm, ctx.config, ctx.state, ctx.kernel = rows, gemm, config, state, kernel
        ctx.reduction = reduction
        ctx.dtypes = (x.dtype, weight.dtype)
        return rows.unpad(out_padded).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x_q, x_scale, w_q, w_scale = ctx.saved_tensors
        rows, config = ctx.rows, ctx.config
        grad_out = grad_out.contiguous()
        g_scale = _row_scales(grad_out, rows, f"{ctx.gemm}_grad_output", config, ctx.state, ctx.reduction)
        g_q = quantize(grad_out, g_scale[:, None], config.gradient_dtype)
        compute_dtype = torch.bfloat16 if ctx.kernel == "scaled_grouped_mm" else torch.float32
        # Unpadded grouped GEMMs: padding only serves the FP8 kernel, and zero rows add nothing here.
        groups = SlotGroups.from_counts(rows.counts, x_q.shape[0], use_grouped_mm=ctx.kernel != "emulated")
        g_hat = dequantize(g_q, g_scale[:, None], compute_dtype)
        x_dtype, w_dtype = ctx.dtypes
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_linear_input_grad(g_hat, dequantize(w_q, w_scale[:, :, None], compute_dtype),
                                               groups).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = grouped_linear_weight_grad(g_hat, dequantize(x_q, x_scale[:, None], compute_dtype),
                                                groups).to(w_dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def fp8_grouped_mlp(tokens: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    tokens_per_slot: torch.Tensor, activate: Callable[[torch.Tensor], torch.Tensor],
                    config: FP8Config, state: FP8ScalingState, kernel: str = "emulated",
                    pad_multiple: int = FP8_ROW_ALIGNMENT,
                    reduction: FP8AmaxReduction = FP8AmaxReduction()) -> torch.Tensor:
    """The expert MLP ``down(act(gate_up(x)))`` of all slots with FP8 GEMMs; tokens [N, H] sorted
    by slot -> [N, H]. ``kernel``: ``"emulated"`` (any device) or ``"scaled_grouped_mm"`` (sm90+).
    ``reduction``: the groups amaxes are reduced over (every rank of a group must call this together)."""
    if kernel not in _KERNELS:
        raise ValueError(f"kernel must be one of {_KERNELS}, got {kernel!r}")
    rows = PaddedRows.build(tokens_per_slot, tokens.shape[0], pad_multiple, exact=kernel == "emulated")
    hidden = FP8GroupedLinearFunction.apply(tokens, w_gate_up, rows, "fc1", config, state, kernel, reduction)
    return FP8GroupedLinearFunction.apply(activate(hidden), w_down, rows, "fc2", config, state, kernel, reduction)


def te_fp8_grouped_mlp(te_gate_up, te_down, tokens: torch.Tensor, tokens_per_slot: torch.Tensor,
                       activate: Callable[[torch.Tensor], torch.Tensor], recipe, fp8_group=None) -> torch.Tensor:
    """TransformerEngine ``GroupedLinear`` pair under ``fp8_autocast(recipe, fp8_group)``, each slot's rows
    padded to a multiple of 16 (TE's FP8 grouped GEMM requirement). ``fp8_group``: the ranks the delayed
    recipe reduces amaxes over (:attr:`FP8AmaxReduction.slot_group`).

    A rank without rows runs both GEMMs on one block of 16 zero rows in slot 0: TE's amax reduction is a
    collective over ``fp8_group`` that runs inside these modules' forward and backward, so a rank that
    skipped them would leave its peers waiting forever. Zero rows have zero amax (the reduced max is the
    peers'), their outputs are dropped, and backward still runs TE's (the output depends on the weights)
    with zero gradients."""
    import transformer_engine.pytorch as te

    if tokens.shape[0] == 0:
        counts = torch.zeros_like(tokens_per_slot)
        counts[0] = FP8_ROW_ALIGNMENT
        padded = tokens.new_zeros(FP8_ROW_ALIGNMENT, tokens.shape[1])
        rows = PaddedRows.build(counts, FP8_ROW_ALIGNMENT, FP8_ROW_ALIGNMENT, exact=True)
    else:
        rows = PaddedRows.build(tokens_per_slot, tokens.shape[0], FP8_ROW_ALIGNMENT, exact=True)
        padded = rows.pad(tokens)
    sizes = rows.padded_counts.tolist()
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=fp8_group):
        hidden = te_gate_up(padded, sizes)
        out = te_down(activate(hidden), sizes)
    return out[:0] if tokens.shape[0] == 0 else rows.unpad(out)
