"""Which decoder layers each pipeline stage holds."""

from __future__ import annotations

from typing import Sequence

__all__ = ["partition_layers"]


def partition_layers(num_layers: int, pp_size: int, split: Sequence[int] | None = None) -> list[range]:
    """Contiguous layer ranges, one per pipeline stage, covering ``range(num_layers)`` in order.

    Without ``split`` the layers are spread evenly and the first ``num_layers % pp_size`` stages take
    one extra layer each (e.g. 10 layers on 4 stages -> 3, 3, 2, 2): the last stage also runs the
    output layer and the loss, so it is the one to lighten. Every stage then needs at least one layer.

    ``split`` gives the layer count of each stage explicitly. Zero is allowed there (e.g. a last stage
    that holds only the output layer and loss, to balance a large vocabulary): an explicit empty
    stage is a deliberate choice, an implicit one from too few layers is an error.
    """
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if split is None:
        if num_layers < pp_size:
            raise ValueError(
                f"num_layers ({num_layers}) < pp_size ({pp_size}) leaves a stage without layers; "
                "pass split=[...] with explicit zeros if empty stages are intended"
            )
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if stage < extra else 0) for stage in range(pp_size)]
    else:
        counts = list(split)
        if len(counts) != pp_size:
            raise ValueError(f"split has {len(counts)} entries but pp_size is {pp_size}; give one count per stage")
        if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts):
            raise ValueError(f"split entries must be integers >= 0 (layers per stage), got {counts}")
        if sum(counts) != num_layers:
            raise ValueError(f"split {counts} sums to {sum(counts)} but num_layers is {num_layers}; make them equal")
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges
