"""Regions of a logical tensor (offsets, shape) and the check that stored or held chunks tile it exactly.

Part of the megamoe checkpoint format (:mod:`megamoe.checkpoint.format`): the save side checks the chunks the
ranks hold, the read side the chunks a manifest lists, and the read planner intersects requested regions
with the stored ones.
"""

from __future__ import annotations

import bisect
import heapq
import math

from megamoe.checkpoint.errors import CheckpointError

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


def _first_overlap(regions: list[Region]) -> tuple[Region, Region] | None:
    """Two overlapping regions (non-empty, of one rank), or None: a sweep along dim 0 that compares each
    region only with those whose dim-0 interval is still open (the pairwise check is quadratic: 20k chunks
    took minutes). In 2-D the open regions are disjoint intervals of dim 1 (else an overlap was already
    found), kept in offset order, so each new one is compared with its two neighbours: O(n log n). In more
    dimensions it is compared with every open one."""
    if len(regions) > 1 and not regions[0][0]:
        return regions[0], regions[1]            # 0-dim regions always overlap
    active: list[tuple[int, int]] = []           # (dim-1 offset or 0, index) of the open regions, in order
    closing: list[tuple[int, int, int]] = []     # heap of (end along dim 0, dim-1 offset or 0, index)
    ordered = sorted(regions)
    for index, region in enumerate(ordered):
        while closing and closing[0][0] <= region[0][0]:
            _, offset, closed = heapq.heappop(closing)
            del active[bisect.bisect_left(active, (offset, closed))]
        offset = region[0][1] if len(region[0]) == 2 else 0
        position = bisect.bisect_left(active, (offset, index))
        candidates = active[max(position - 1, 0):position + 1] if len(region[0]) == 2 else active
        for _, other in candidates:
            if _intersection(ordered[other], region) is not None:
                return ordered[other], region
        active.insert(position, (offset, index))
        heapq.heappush(closing, (region[0][0] + region[1][0], offset, index))
    return None


def _check_tiling(name: str, global_shape: tuple[int, ...], regions: list[Region], what: str) -> None:
    """The regions must not overlap and must cover the logical tensor exactly."""
    regions = [r for r in regions if math.prod(r[1])]
    if (not regions and not math.prod(global_shape)) or _is_grid(global_shape, regions):
        return
    overlap = _first_overlap(regions)
    if overlap is not None:
        a, b = overlap
        raise CheckpointError(
            f"{what} of logical tensor {name!r} overlap without being equal: offsets {a[0]} shape {a[1]} and "
            f"offsets {b[0]} shape {b[1]} (the ranks disagree on its layout)")
    covered, total = sum(math.prod(r[1]) for r in regions), math.prod(global_shape)
    if covered != total:
        raise CheckpointError(f"{what} of logical tensor {name!r} cover {covered} of its {total} elements "
                              f"(global shape {global_shape}): some part of it is held by no rank")
