"""The KV block ids of the paged cache: which are free, how many requests reference each.

A request's block table lists its blocks in position order (position ``p`` lives in slot
``p % block_size`` of block ``table[p // block_size]``). Blocks are shared between requests through the
prefix cache (a reference count per block); a block whose count drops to 0 goes back to the free list,
or, when the prefix cache holds it, stays cached and evictable (:mod:`megamoe.serving.prefix_cache`).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from megamoe.serving.prefix_cache import PrefixCache

__all__ = ["BlockPool"]


class BlockPool:
    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None = None):
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks a request can get now: free ones and unreferenced cached ones (evicted on demand)."""
        return len(self.free) + (len(self.prefix_cache.unreferenced) if self.prefix_cache is not None else 0)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.num_free

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks for new content (free ones first, then LRU-evicted cached ones), each referenced
        once; None (and nothing taken) when fewer are available."""
        if count > self.num_free:
            return None
        blocks = []
        for _ in range(count):
            block = self.free.popleft() if self.free else self.prefix_cache.evict()
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def acquire(self, block: int) -> None:
        """One more reference to a cached ``block`` (a prefix-cache hit)."""
        if self.refs[block] == 0 and self.prefix_cache is not None:
            self.prefix_cache.unpark(block)
        self.refs[block] += 1

    def release(self, blocks: Iterable[int | None]) -> None:
        """Drop one reference to each block (None entries skipped); unreferenced blocks become free, or
        cached and evictable."""
        for block in blocks:
            if block is None:
                continue
            if self.refs[block] < 1:
                raise RuntimeError(f"KV block {block} released more often than referenced")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.prefix_cache is not None and self.prefix_cache.holds(block):
                    self.prefix_cache.park(block)
                else:
                    self.free.append(block)
