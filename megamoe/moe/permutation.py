"""Group (token, slot) pairs by slot for the grouped GEMMs, and undo it with the weighted combine.

Pairs whose slot id is -1 (or any id outside ``[0, num_slots)``) are not dispatched: another rank's
slot, or dropped by a capacity limit. They contribute nothing to the combine and get a zero
routing-weight gradient.

Each backward touches only the rows actually dispatched: the permutation is one row gather
(backward: one sum into the ``[T, H]`` gradient, in fp32: :mod:`megamoe.moe.row_sums`), and the combine
is a hand-written autograd function whose backward gathers the output gradient once per row and derives
from it both the expert-output gradient and the routing-weight gradient; no zero-filled ``[T * K, H]``
gradient, no inverse permutation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.host_values import even_split, host_ints
from megamoe.moe.row_sums import gather_rows, sum_rows

__all__ = ["PermutationState", "sort_by_slot", "pairs_per_slot", "permute_by_slot", "unpermute_and_combine"]


@dataclass
class PermutationState:
    """What the combine needs to undo :func:`permute_by_slot` (N = dispatched pairs)."""

    token_index: torch.Tensor   # [N] int64 source token row of each permuted row
    pair_index: torch.Tensor    # [N] int64 flat index (t * K + k) of each permuted row's pair
    num_tokens: int
    rows_per_slot: list[int] | None = None      # host ints: the rows of every slot (they sum to N)
    deterministic: bool = False                 # the sums in a fixed order (megamoe.moe.row_sums)


def sort_by_slot(slot_ids_flat: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order of pairs by slot.

    ``slot_ids_flat`` [M] int -> (``permutation`` [M] int64: pair indices, slot 0's first, ties in
    input order, ids outside ``[0, num_slots)`` last; ``tokens_per_slot`` [num_slots] int64, which
    counts only valid ids). No host synchronisation.
    """
    if slot_ids_flat.dim() != 1:
        raise ValueError(f"slot_ids_flat must be 1-D, got shape {tuple(slot_ids_flat.shape)}")
    valid = (slot_ids_flat >= 0) & (slot_ids_flat < num_slots)
    keys = torch.where(valid, slot_ids_flat, num_slots)
    sorted_keys, permutation = torch.sort(keys, stable=True)
    slot_starts = torch.searchsorted(
        sorted_keys, torch.arange(num_slots + 1, device=keys.device, dtype=sorted_keys.dtype))
    return permutation, slot_starts.diff()


def pairs_per_slot(slot_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[num_slots] int64: how many of the pairs ``slot_ids`` (any shape; ids outside ``[0, num_slots)`` are
    not counted) go to each slot. No host read (an integer sum: the same in any order)."""
    flat = slot_ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_slots)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=flat.device)
    return counts.index_add_(0, torch.where(valid, flat, num_slots), torch.ones_like(flat))[:num_slots]


def permute_by_slot(tokens: torch.Tensor, slot_ids: torch.Tensor, num_slots: int,
                    rows_per_slot: list[int] | None = None, deterministic: bool = False):
    """tokens [T, H], slot_ids [T, K] (-1 = skip) -> (rows [N, H] grouped by slot in ascending order,
    stable in (token, k) order; tokens_per_slot [num_slots] int64; state for the combine).

    Gradients flow to ``tokens`` (one scatter-add of the N row gradients). The output size depends on the
    number of dispatched pairs: ``rows_per_slot`` gives them when the caller already holds them on the host
    (the all-to-all dispatcher receives them with its split sizes); otherwise they are read here, all slots
    in one read (one sync on accelerators). Either way ``state.rows_per_slot`` keeps them, so that the
    experts need no read of their own. The token gradient and the combine sum in fp32, in a fixed order
    with ``deterministic`` (:mod:`megamoe.moe.row_sums`).
    """
    if slot_ids.dim() != 2 or slot_ids.shape[0] != tokens.shape[0]:
        raise ValueError(f"slot_ids must be [T, K] with T = {tokens.shape[0]}, got {tuple(slot_ids.shape)}")
    top_k = slot_ids.shape[1]
    permutation, tokens_per_slot = sort_by_slot(slot_ids.reshape(-1), num_slots)
    if rows_per_slot is None:     # meta: every pair valid, spread evenly over the slots
        rows_per_slot = host_ints(tokens_per_slot, on_meta=even_split(slot_ids.numel(), num_slots))
    elif len(rows_per_slot) != num_slots:
        raise ValueError(f"rows_per_slot has {len(rows_per_slot)} entries for {num_slots} slots")
    num_rows = sum(rows_per_slot)
    pair_index = permutation[:num_rows]
    token_index = torch.div(pair_index, top_k, rounding_mode="floor")
    # The gather's backward is one sum into a [T, H] buffer (the gradient's size).
    rows = gather_rows(tokens, token_index, max_per_row=top_k, deterministic=deterministic)
    return rows, tokens_per_slot, PermutationState(token_index, pair_index, tokens.shape[0], list(rows_per_slot),
                                                   deterministic)


def unpermute_and_combine(expert_output: torch.Tensor, weights: torch.Tensor, state: PermutationState):
    """expert_output [N, H] (permuted rows), weights [T, K] -> [T, H]: sum over each token's pairs of
    weight * output (zero for a token without dispatched pairs). Gradients flow to expert_output and
    to weights."""
    if expert_output.dim() != 2 or expert_output.shape[0] != state.token_index.shape[0]:
        raise ValueError(f"expert_output must be [{state.token_index.shape[0]}, H], got "
                         f"{tuple(expert_output.shape)}")
    if weights.dim() != 2 or weights.shape[0] != state.num_tokens:
        raise ValueError(f"weights must be [{state.num_tokens}, K], got {tuple(weights.shape)}")
    if torch.is_grad_enabled():
        return _WeightedCombine.apply(expert_output, weights, state.token_index, state.pair_index, state.deterministic)
    return _weighted_combine(expert_output, weights, state.token_index, state.pair_index,   # inference
                             state.deterministic)[0]


def _weighted_combine(expert_output, weights, token_index, pair_index, deterministic):
    """(out [T, H], row_weights [N] in the accumulation dtype): see :class:`_WeightedCombine`."""
    acc_dtype = torch.promote_types(expert_output.dtype, torch.float32)
    row_weights = weights.reshape(-1).index_select(0, pair_index).to(acc_dtype)    # [N]
    # the product promotes the rows to the weights' dtype as it reads them: no upcast copy of the rows
    out = sum_rows(expert_output * row_weights.unsqueeze(1), token_index, weights.shape[0],
                   max_per_out=weights.shape[1], deterministic=deterministic)
    return out.to(expert_output.dtype), row_weights


class _WeightedCombine(torch.autograd.Function):
    """out[t] = sum over rows i of token t: w[pair(i)] * e[i], accumulated in fp32 or wider.

    Backward, with g = grad_out[token(i)] gathered once per row: de[i] = w[pair(i)] * g and
    dw[pair(i)] = <e[i], g> (in fp32 or wider); undispatched pairs get dw = 0.

    Both products take the routing weight as it is (fp32 from the router), in fp32 or wider, and round
    once to the expert output's dtype, as Megatron-Core's ``unpermute``
    (megatron/core/transformer/moe/moe_utils.py: ``permuted_tokens * permuted_probs`` promotes to the probs'
    fp32, and autograd rounds the gradient once to the tokens' dtype). In bf16, weight 0.9 times gradient
    3.0 is bf16(2.7) = 2.703125; rounding the weight first (0.8984375) would give 2.6875.
    """

    @staticmethod
    def forward(ctx, expert_output, weights, token_index, pair_index, deterministic):
        out, row_weights = _weighted_combine(expert_output, weights, token_index, pair_index, deterministic)
        ctx.save_for_backward(expert_output, row_weights, token_index, pair_index)
        ctx.weights_shape, ctx.weights_dtype = weights.shape, weights.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        expert_output, row_weights, token_index, pair_index = ctx.saved_tensors
        grad_rows = grad_out.index_select(0, token_index)                 # [N, H], contiguous
        acc_dtype = row_weights.dtype
        grad_rows_acc = grad_rows.to(acc_dtype)          # cast once for both products (itself in fp32)
        grad_weights = None
        if ctx.needs_input_grad[1]:
            row_dots = torch.linalg.vecdot(expert_output.to(acc_dtype), grad_rows_acc)  # [N]
            grad_weights = row_dots.new_zeros(ctx.weights_shape.numel()).index_copy_(0, pair_index, row_dots)
            grad_weights = grad_weights.view(ctx.weights_shape).to(ctx.weights_dtype)
        grad_expert_output = None
        if ctx.needs_input_grad[0]:
            if grad_rows.dtype == acc_dtype:
                grad_expert_output = grad_rows.mul_(row_weights.unsqueeze(1))
            else:        # the product in the weights' precision, rounded once (see the class docstring)
                grad_expert_output = grad_rows_acc.mul_(row_weights.unsqueeze(1)).to(grad_rows.dtype)
        return grad_expert_output, grad_weights, None, None, None
