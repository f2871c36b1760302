"""Which decoder layers each pipeline stage holds."""

from __future__ import annotations

from typing import Sequence

__all__ = ["chunk_layer_ranges", "partition_layers"]


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


def chunk_layer_ranges(num_layers: int, pp: int, virtual_pipeline_stages: int = 1,
                       pp_split=None) -> list[list[range]]:
    """``[pp_rank][chunk]`` -> the layer range of virtual stage ``chunk * pp + pp_rank`` (Megatron-Core's
    layout: rank ``r`` holds chunks ``r, r + pp, ...``). ``pp_split``: one layer count per virtual stage
    (``pp * V`` entries; zeros allowed, as in :func:`partition_layers`) or None: equal virtual stages,
    which with V > 1 needs ``num_layers`` divisible by ``pp * V``. ValueError naming the numbers for a
    layout that does not fit."""
    v = virtual_pipeline_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_pipeline_stages must be an int >= 1, got {v!r}")
    if v > 1 and pp == 1:
        raise ValueError(f"virtual_pipeline_stages={v} needs pipeline parallelism (pp > 1), got pp={pp}: the "
                         "interleaved schedule spreads each rank's chunks over a pipeline")
    stages = pp * v
    if v > 1 and pp_split is None and (num_layers % stages or num_layers < stages):
        raise ValueError(f"num_layers ({num_layers}) must split into pp * virtual_pipeline_stages = {pp} * {v} = "
                         f"{stages} virtual stages of equal size (>= 1 layer each); change the numbers or pass "
                         f"pp_split with {stages} layer counts")
    if v > 1 and pp_split is not None and len(pp_split) != stages:
        raise ValueError(f"pp_split has {len(pp_split)} entries, but pp * virtual_pipeline_stages = {pp} * {v} = "
                         f"{stages}: give one layer count per virtual stage")
    ranges = partition_layers(num_layers, stages, pp_split)
    return [[ranges[chunk * pp + rank] for chunk in range(v)] for rank in range(pp)]
