"""The padded-batch layout of the expert rows: every slot's rows padded with zero rows to the fullest
slot's count, so that each projection of all slots is ONE batched GEMM (``torch.bmm``) instead of one
GEMM per slot (used by :class:`megamoe.moe.experts.grouped_mlp.GroupedMLPFunction`).

Why: on CPU a bf16 GEMM call has a fixed cost that fp32's has not, so the per-slot loop of small GEMMs
loses bf16's gain. Measured on the test bench (AMD EPYC with avx512_bf16, no AMX, torch 2.13, one thread,
loaded host, minima of 30): one 32 x 128 x 128 GEMM took 37 us in bf16 against 22 us in fp32, and 8 slots
of it took 299 us as a per-slot loop against 65 us as one bf16 ``bmm`` over the padded slots (fp32: 200
against 132 us). At 256 x 1024 x 1024 per slot the loop and the ``bmm`` ran the same in both dtypes:
there the call cost is negligible and padding only adds work. ``torch._grouped_mm`` on CPU is a serial
loop of GEMMs as well (233 us for the 8 small slots above).

So the padded layout is taken where the work it wastes on zero rows costs less than the GEMM calls it
saves (:func:`padded_bmm_applies`): for low-precision rows on CPU when the padded rows' extra work is at
most :data:`CALL_COST_FLOPS` per non-empty slot and GEMM. fp32 keeps the per-slot loop (its call cost is
small, and it is the oracle tests' path). Zero rows stay zero through the MLP's backward (a gradient of
zero rows), so the weight gradients are exact sums over the real rows; the forward's padded outputs
(``act(bias)`` with biases) are dropped by :meth:`PaddedSlots.unpad`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CALL_COST_FLOPS", "PaddedSlots", "padded_bmm_applies"]

# The fixed cost of one bf16 GEMM call on CPU in GEMM work it could have done instead: about 30 us at
# about 100 GFLOP/s on the test bench (see the module docstring).
CALL_COST_FLOPS = 3e6
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def padded_bmm_applies(sizes: list[int], device: torch.device, dtype: torch.dtype | None, row_flops: int) -> bool:
    """Whether the expert GEMMs of rows of ``dtype`` on ``device``, ``sizes`` rows per slot, run as batched
    GEMMs over the padded slots: a CPU, bf16 or fp16 rows, at least one row, and the zero rows' work (at
    ``row_flops`` per row: ``2 * H * (G + 1) * F_shard`` over the forward's two projections) at most the
    fixed cost :data:`CALL_COST_FLOPS` of the two per-slot GEMM calls the non-empty slots would make."""
    if device.type != "cpu" or dtype not in _LOW_PRECISION or not sizes or sum(sizes) == 0:
        return False
    busy = sum(1 for n in sizes if n > 0)
    wasted_rows = len(sizes) * max(sizes) - sum(sizes)
    return wasted_rows * row_flops <= 2 * busy * CALL_COST_FLOPS


@dataclass(frozen=True)
class PaddedSlots:
    """Rows grouped by slot (``sizes`` rows each, slot 0's first) <-> the padded batch [S, C, D] with
    C = ``capacity`` = max(sizes); ``positions`` [N] int64: each row's index in the flattened [S * C]."""

    num_slots: int
    capacity: int
    positions: torch.Tensor | None       # None: the rows are the batch already (every slot full)

    @classmethod
    def from_sizes(cls, sizes: list[int], device: torch.device) -> PaddedSlots:
        capacity = max(sizes)
        if all(n == capacity for n in sizes):
            return cls(len(sizes), capacity, None)
        counts = torch.tensor(sizes, dtype=torch.int64, device=device)
        num_rows = sum(sizes)
        slot_of_row = torch.repeat_interleave(torch.arange(len(sizes), device=device), counts, output_size=num_rows)
        first_row = torch.cumsum(counts, 0) - counts                                   # [S] each slot's first row
        within = torch.arange(num_rows, device=device) - first_row.index_select(0, slot_of_row)
        return cls(len(sizes), capacity, slot_of_row * capacity + within)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [S, C, D], zero rows after each slot's own."""
        if self.positions is None:
            return rows.view(self.num_slots, self.capacity, rows.shape[1])
        batch = rows.new_zeros(self.num_slots * self.capacity, rows.shape[1])
        return batch.index_copy_(0, self.positions, rows).view(self.num_slots, self.capacity, rows.shape[1])

    def unpad(self, batch: torch.Tensor) -> torch.Tensor:
        """[S, C, D] -> [N, D], the real rows (a view of ``batch`` when every slot is full)."""
        flat = batch.reshape(self.num_slots * self.capacity, batch.shape[2])
        return flat if self.positions is None else flat.index_select(0, self.positions)
