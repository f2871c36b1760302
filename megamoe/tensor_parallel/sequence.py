"""Entering the tensor-parallel region of a block, with or without sequence parallelism.

A TP block (attention, dense MLP) reads hidden states every TP rank needs in full. Without sequence
parallelism every rank already holds the full [B, S, H] input: the block's entry is
``copy_to_tensor_parallel_region`` (forward identity, backward all-reduce of the input gradient).
With it, each rank holds a contiguous chunk [B, S / tp, H] of the sequence dim (``SEQUENCE_DIM``):
the entry all-gathers the chunks forward and reduce-scatters the input gradient backward (each
rank's heads / FFN columns contribute a partial gradient to every position; the reduce-scatter sums
them and hands each rank its own chunk). The block's row-parallel exit then reduce-scatters its
output along the same dim instead of all-reducing it. Same bytes as the all-reduce pair (a ring
all-reduce IS a reduce-scatter plus an all-gather), but norms, residuals and dropout between blocks
touch 1/tp of the activations.

Blocks whose entry feeds column-parallel projections directly (GQA's q/k/v, the dense MLP's gate/up)
use :func:`megamoe.comms.gather_linears_from_sequence_parallel_region` instead, which keeps only the
chunk for backward (gathering it again there); this entry keeps the gathered tensor (MLA's latents,
consumed by more than projections).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from megamoe import comms

__all__ = ["SEQUENCE_DIM", "enter_tensor_parallel_region"]

SEQUENCE_DIM = 1        # hidden states are batch-first [B, S, H]


def enter_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None, sequence_parallel: bool) -> torch.Tensor:
    """``x`` [B, S, ...] (or this rank's chunk [B, S / tp, ...] under sequence parallelism) -> the full
    [B, S, ...] inside the TP region; see the module docstring for the gradients."""
    if sequence_parallel:
        return comms.gather_from_sequence_parallel_region(x, group, dim=SEQUENCE_DIM)
    return comms.copy_to_tensor_parallel_region(x, group)
