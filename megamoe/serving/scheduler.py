"""Which tokens of which requests the next engine step computes.

Per step, under a budget of ``max_num_batched_tokens`` tokens:

1. running requests that decode (one token each), oldest first;
2. running requests still prefilling, a chunk each (chunked prefill: a long prompt takes several steps, and
   never delays the decodes, which are scheduled before it);
3. waiting requests, oldest first, while ``max_num_seqs`` allows: a prefix-cache lookup first (full blocks
   of its tokens found by content are shared, not computed), then a chunk of the rest. A request whose next
   full block (after the cached ones) is one a running request is about to compute (two requests with one
   system prompt that arrive together) waits, ahead of later arrivals, until that block is registered, and
   then shares it; the requests behind it are admitted meanwhile.

Blocks. A request gets the blocks its scheduled positions need. When none are left (after evicting
unreferenced cached blocks), the NEWEST running request is preempted: its blocks are released and it goes
back to the front of the queue, to be recomputed (its prompt and generated tokens, as one prefill; its
sampling generator is kept, so its next tokens are those it would have produced). A waiting request is
never admitted by preempting a running one: it waits. When every layer has a sliding window, blocks that
lie wholly behind the widest window are released as the request advances. When the sliding layers have
their own block table (``split_window``: models mixing sliding and full layers, see
:mod:`megamoe.serving.paged_kv_cache`), a request's positions take a block in each table, and the sliding
table's blocks behind the window are released the same way; both tables' full blocks are prefix-cached (the
sliding ones under their own keys), and a hit covers the blocks whose sliding blocks inside the window of
the first computed position are cached too.

A finished or aborted request releases its blocks at once (its last blocks first, so the LRU evicts them
before the shared prefix ones).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from megamoe.serving.block_pool import BlockPool
from megamoe.serving.config import EngineConfig
from megamoe.serving.prefix_cache import PrefixCache, chained_block_hashes
from megamoe.serving.request import Request

__all__ = ["Scheduler", "StepSchedule"]


@dataclass
class StepSchedule:
    """The step's chunks in order: (request, number of tokens from ``request.num_computed`` on)."""

    chunks: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, window: int | None = None,
                 split_window: int | None = None):
        self.config = config
        self.block_size = config.block_size
        self.prefix_cache = PrefixCache() if config.enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        self.window = window                      # every layer's sliding window at most this; None: full
        self.split_window = split_window          # the sliding layers' window when they have their own table
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    # -- requests in and out

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """Remove ``request`` (finished or aborted) wherever it is and release its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        # Last positions first, each position's blocks of both tables together (the LRU keeps the prefix longest).
        pairs = list(itertools.zip_longest(request.block_table, request.window_table))
        self.pool.release(block for pair in reversed(pairs) for block in pair)
        request.block_table, request.window_table = [], []
        request.num_computed = 0
        request.blocks_registered = 0

    # -- one step

    def schedule(self) -> StepSchedule:
        step = StepSchedule()
        budget = self.config.max_num_batched_tokens
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for request in decoding + prefilling:
            if budget == 0:
                break
            if request not in self.running:           # preempted by an older request of this step
                continue
            count = min(request.num_tokens - request.num_computed, budget)
            self._release_behind_window(request)
            while not self._grow(request, request.num_computed + count):
                victim = max(self.running, key=lambda r: r.arrival)
                budget += self._preempt(victim, step)
                if victim is request:
                    break
            if request in self.running:
                step.chunks.append((request, count))
                budget -= count
        deferred = []                 # waiting for a running request to compute blocks of their prefix
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request in step.preempted:               # not back in the step that preempted it
                break
            cached = self._lookup_prefix(request)
            if self._prefix_in_flight(request):
                self._release(request)                  # the cached blocks it took: it looks again next step
                deferred.append(self.waiting.popleft())
                continue
            count = min(request.num_tokens - request.num_computed, budget)
            if not self._grow(request, request.num_computed + count):
                self._release(request)                  # the cached blocks it took
                break
            self._count_prefix_lookup(request, cached)
            self.waiting.popleft()
            self.running.append(request)
            step.chunks.append((request, count))
            budget -= count
        self.waiting.extendleft(reversed(deferred))     # in their order, still ahead of later arrivals
        return step

    def _grow(self, request: Request, positions: int) -> bool:
        """Blocks for ``positions`` positions of ``request``; False (nothing taken) when the pool is short."""
        blocks = -(-positions // self.block_size)
        need = max(0, blocks - len(request.block_table))
        need_window = max(0, blocks - len(request.window_table)) if self.split_window is not None else 0
        if need + need_window == 0:
            return True
        new = self.pool.allocate(need + need_window)
        if new is None:
            return False
        request.block_table.extend(new[:need])
        request.window_table.extend(new[need:])
        return True

    def _preempt(self, victim: Request, step: StepSchedule) -> int:
        """Preempt ``victim``; the tokens it had in this step's schedule (now given back to the budget)."""
        self.running.remove(victim)
        self._release(victim)
        self.waiting.appendleft(victim)
        self.preemptions += 1
        step.preempted.append(victim)
        freed = sum(count for r, count in step.chunks if r is victim)
        step.chunks = [(r, count) for r, count in step.chunks if r is not victim]
        return freed

    def _release_behind_window(self, request: Request) -> None:
        """Release the blocks no layer reads again: those before ``num_computed - window + 1`` (of the
        sliding layers' own table when they have one)."""
        if self.window is not None:
            self._release_before(request.block_table, request.num_computed - self.window + 1)
        if self.split_window is not None:
            self._release_before(request.window_table, request.num_computed - self.split_window + 1)

    def _release_before(self, table: list[int | None], position: int) -> None:
        dead = position // self.block_size                                   # blocks wholly behind
        for index in range(min(dead, len(table))):
            block = table[index]
            if block is not None:
                self.pool.release([block])
                table[index] = None

    # -- prefix cache

    def _lookup_prefix(self, request: Request) -> int:
        """Share the cached blocks of ``request``'s leading full blocks (at least its last token is left to
        compute: it gives the logits); the number of tokens found."""
        if self.prefix_cache is None or request.num_computed or request.block_table:
            return 0
        hashes = chained_block_hashes(request.tokens, self.block_size, request.block_hashes)
        blocks = self.prefix_cache.lookup(hashes[:(request.num_tokens - 1) // self.block_size])
        window_blocks, window_dead = [], 0
        if self.split_window is not None:
            blocks, window_blocks, window_dead = self._split_hit(blocks, hashes)
        found = len(blocks) * self.block_size
        # With every layer sliding, the blocks behind the window of the first query are not taken.
        dead = 0 if self.window is None else min(len(blocks), max(0, (found - self.window + 1) // self.block_size))
        for block in blocks[dead:] + window_blocks:
            self.pool.acquire(block)
        request.block_table = [None] * dead + list(blocks[dead:])
        request.window_table = [None] * window_dead + window_blocks
        request.num_computed = found
        return found

    def _split_hit(self, blocks: list[int], hashes: list[bytes]) -> tuple[list[int], list[int], int]:
        """The longest run of the cached full-layer ``blocks`` whose sliding-layer blocks inside the window of
        the first position after it are cached too: (its full-layer blocks, those sliding blocks, the number
        of sliding blocks wholly behind that window)."""
        for count in range(len(blocks), 0, -1):
            dead = max(0, (count * self.block_size - self.split_window + 1) // self.block_size)
            window_blocks = self.prefix_cache.lookup_each([_window_key(key) for key in hashes[dead:count]])
            if None not in window_blocks:
                return blocks[:count], window_blocks, dead
        return [], [], 0

    def _prefix_in_flight(self, request: Request) -> bool:
        """Whether the next full block of ``request``'s prompt (after its cached prefix, just looked up) is one
        a running request is computing (in this step or a later one) and will register: then ``request``
        waits for it rather than computing the same block again (two requests with one system prompt that
        arrive together share it, as later arrivals do)."""
        if self.prefix_cache is None or not self.running:
            return False
        wanted = request.num_computed // self.block_size          # its first block not found in the cache
        if wanted >= (request.num_tokens - 1) // self.block_size:    # no further full block it could share
            return False
        key = request.block_hashes[wanted]
        return any(key in r.block_hashes[r.blocks_registered:] for r in self.running)

    def _count_prefix_lookup(self, request: Request, cached: int) -> None:
        if self.prefix_cache is None:
            return
        first = request.num_cached_tokens is None
        self.prefix_cache.queries += request.num_tokens
        self.prefix_cache.hits += cached
        if first:
            request.num_cached_tokens = min(cached, len(request.prompt))

    def register_full_blocks(self, request: Request) -> None:
        """Offer ``request``'s computed full blocks to the prefix cache."""
        full = request.num_computed // self.block_size
        if self.prefix_cache is None or full <= request.blocks_registered:      # most decode steps: no new block
            return
        hashes = chained_block_hashes(request.tokens[:full * self.block_size], self.block_size, request.block_hashes)
        for index in range(request.blocks_registered, full):
            block = request.block_table[index]
            if block is not None:
                self.prefix_cache.insert(block, hashes[index])
            block = request.window_table[index] if index < len(request.window_table) else None
            if block is not None:
                self.prefix_cache.insert(block, _window_key(hashes[index]))
        request.blocks_registered = max(request.blocks_registered, full)


def _window_key(key: bytes) -> bytes:
    """The prefix-cache key of a sliding-layer block (a split cache) holding the positions of ``key``'s."""
    return b"w" + key
