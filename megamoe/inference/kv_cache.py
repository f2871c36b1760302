"""A pre-allocated KV cache for one attention layer, shared by a batch of left-padded sequences.

It implements the :class:`megamoe.transformer.attention.KVCache` seam: ``update(a, b)`` stores this
call's entries along dim -2 and returns the cached positions. What ``a`` and ``b`` are is the
attention's choice: rotated keys and values [B, kv_heads_local, S, head_dim] for GQA; for MLA the
normed compressed latent [B, 1, S, kv_lora_rank] and the rotated shared rope key
[B, 1, S, qk_rope_head_dim] (never the per-head K / V, which are recomputed from the latent).

Padding: left. Every sequence of the batch ends at the same cache index, so one write position
serves the whole batch and a decode step appends one column; padding positions are hidden by the
model's ``attention_mask`` (which the generation loop owns), not by the cache.

The two buffers [B, ..., max_length, D] are allocated by the first ``update`` (the prefill), with
that call's batch, head count, width, dtype and device, so the cache needs no knowledge of the
attention kind; later updates write in place (no concatenation, no reallocation). They start zeroed:
positions not yet written are masked out, but a masked NaN would still poison the attention's
weighted sum (0 * NaN), so they must hold finite values.

Two ways to write (see ``write_index``):

- appending (default): the entries go to ``[length, length + S)`` and the returned views span
  ``[0, length + S)``, so the attention's keys grow step by step;
- by index (compiled decoding): with ``write_index`` set (a tensor of cache indices, owned and
  advanced by the caller), the entries are written there and the WHOLE buffers are returned, so the
  update holds no host-side integer; :attr:`query_positions` then tells the attention where its
  queries sit, and the attention uses the first ``attention_mask.shape[-1]`` positions (see
  :func:`megamoe.transformer.attention.cached_keys`).
"""

from __future__ import annotations

import torch

__all__ = ["StaticKVCache"]


class StaticKVCache:
    """One layer's cache with room for ``max_length`` positions (prompt + generated tokens)."""

    def __init__(self, max_length: int):
        if max_length < 1:
            raise ValueError(f"StaticKVCache.max_length must be >= 1, got {max_length}")
        self.max_length = max_length
        self.length = 0                                            # positions appended so far
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        # [S] int64 cache indices of the next update's entries; None: append at `length`.
        self.write_index: torch.Tensor | None = None

    @property
    def query_positions(self) -> torch.Tensor | None:
        """Cache indices [S] of the last update's entries when writing with ``write_index``; None when
        appending (the entries are then the last S of the returned positions)."""
        return self.write_index

    def update(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``a`` [..., S, Da] and ``b`` [..., S, Db] and return the cached positions of both: views
        of ``[0, length + S)`` when appending, the whole buffers with ``write_index`` set."""
        if self.write_index is None:
            end = self.length + a.shape[-2]
            if end > self.max_length:
                raise ValueError(f"StaticKVCache is full: {self.length} cached + {a.shape[-2]} new positions exceed "
                                 f"max_length={self.max_length}; allocate the cache for prompt + new tokens")
        if self.buffers is None:
            self.buffers = tuple(t.new_zeros((*t.shape[:-2], self.max_length, t.shape[-1])) for t in (a, b))
        for buffer, new in zip(self.buffers, (a, b)):
            if new.shape[:-2] != buffer.shape[:-2] or new.shape[-1] != buffer.shape[-1]:
                raise ValueError(f"StaticKVCache holds entries of shape {tuple(buffer.shape[:-2])} x [positions] x "
                                 f"{buffer.shape[-1]}, got {tuple(new.shape)}")
        if self.write_index is not None:
            for buffer, new in zip(self.buffers, (a, b)):
                buffer.index_copy_(-2, self.write_index, new.to(buffer.dtype))
            return self.buffers
        for buffer, new in zip(self.buffers, (a, b)):
            buffer[..., self.length:end, :].copy_(new)
        self.length = end
        return self.buffers[0][..., :end, :], self.buffers[1][..., :end, :]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (0 before the first update)."""
        return 0 if self.buffers is None else sum(t.numel() * t.element_size() for t in self.buffers)
