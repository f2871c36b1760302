"""Prefix caching: full KV blocks found again by their content.

Each full block of a request's tokens is keyed by a chained hash: ``blake2b(parent hash, the block's token
ids)``, so a key names the whole prefix up to the block's end, not just its own tokens. A block that a
request filled is registered under its key; a later request whose tokens start the same way takes the
cached blocks (their reference counts go up) instead of computing them. A cached block that no request
references stays cached, in least-recently-used order, until the block pool needs it for new content
(then its key is forgotten): blocks are evicted only when no free one is left.

Hit counters are in tokens: ``queries`` counts the prompt tokens looked up, ``hits`` those found.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

__all__ = ["PrefixCache", "chained_block_hashes"]


def chained_block_hashes(tokens: Sequence[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """``known`` (the keys of the first ``len(known)`` full blocks of ``tokens``) extended, in place, with
    the keys of the following full blocks."""
    for start in range(len(known) * block_size, len(tokens) - block_size + 1, block_size):
        digest = hashlib.blake2b(known[-1] if known else b"", digest_size=16)
        digest.update(b",".join(str(int(t)).encode() for t in tokens[start:start + block_size]))
        known.append(digest.digest())
    return known


class PrefixCache:
    """Key -> block id for the cached full blocks, and the LRU order of those no request references."""

    def __init__(self):
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.unreferenced: OrderedDict[int, None] = OrderedDict()   # oldest first
        self.queries = 0               # prompt tokens looked up
        self.hits = 0                  # prompt tokens found

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of leading keys in ``hashes``."""
        blocks = []
        for key in hashes:
            block = self.by_hash.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def lookup_each(self, keys: Sequence[bytes]) -> list[int | None]:
        """The cached block of each of ``keys`` (None where there is none)."""
        return [self.by_hash.get(key) for key in keys]

    def insert(self, block: int, key: bytes) -> None:
        """Register a freshly filled ``block`` under ``key`` (kept uncached when another block holds it)."""
        if key not in self.by_hash and block not in self.hash_of:
            self.by_hash[key] = block
            self.hash_of[block] = key

    def holds(self, block: int) -> bool:
        return block in self.hash_of

    def park(self, block: int) -> None:
        """``block`` (cached) lost its last reference: the newest in LRU order."""
        self.unreferenced[block] = None

    def unpark(self, block: int) -> None:
        """``block`` is referenced again."""
        self.unreferenced.pop(block, None)

    def evict(self) -> int | None:
        """The least recently used unreferenced block, its key forgotten; None when there is none."""
        if not self.unreferenced:
            return None
        block, _ = self.unreferenced.popitem(last=False)
        del self.by_hash[self.hash_of.pop(block)]
        return block
