"""Regions of a logical tensor (offsets, shape) and the check that stored or held chunks tile it exactly.

Part of the megamoe checkpoint format (:mod:`checkpoint_tools.format`): the save side checks the chunks the
ranks hold, the read side the chunks a manifest lists, and the read planner intersects requested regions
with the stored ones.
"""

from __future__ import annotations

import math

from checkpoint_tools.errors import CheckpointError

Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def _intersection(a: Region, b: Region) -> Region | None:
    """The overlap of two regions (``None`` when empty); 0-dim regions always overlap."""
    lo = tuple(max(oa, ob) for oa, ob in zip(a[0], b[0]))
    hi = tuple(min(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _slices(region: Region, origin: tuple[int, ...]) -> tuple[slice, ...]:
    """``region`` as slices into a tensor whose element 0 sits at ``origin``."""
    return tuple(slice(o - base, o - base + s) for o, s, base in zip(region[0], region[1], origin))


def _is_grid(global_shape: tuple[int, ...], regions: list[Region]) -> bool:
    """True when the regions are every cell of a grid: per dimension, their intervals partition it, and
    there are as many distinct regions as cells (each region is a cell, so they are all of them, once).
    The common case (TP / ETP shards), checked in O(n log n) instead of the pairwise O(n^2)."""
    cells = 1
    for dim, size in enumerate(global_shape):
        intervals = sorted({(r[0][dim], r[1][dim]) for r in regions})
        end = 0
        for offset, length in intervals:
            if offset != end:
                return False
            end += length
        if end != size:
            return False
        cells *= len(intervals)
    return len(set(regions)) == len(regions) == cells


def _check_tiling(name: str, global_shape: tuple[int, ...], regions: list[Region], what: str) -> None:
    """The regions must not overlap and must cover the logical tensor exactly."""
    regions = [r for r in regions if math.prod(r[1])]
    if _is_grid(global_shape, regions):
        return
    for i, a in enumerate(regions):
        for b in regions[i + 1:]:
            if _intersection(a, b) is not None:
                raise CheckpointError(
                    f"{what} of logical tensor {name!r} overlap without being equal: offsets {a[0]} shape {a[1]} and "
                    f"offsets {b[0]} shape {b[1]} (the ranks disagree on its layout)")
    covered, total = sum(math.prod(r[1]) for r in regions), math.prod(global_shape)
    if covered != total:
        raise CheckpointError(f"{what} of logical tensor {name!r} cover {covered} of its {total} elements "
                              f"(global shape {global_shape}): some part of it is held by no rank")
