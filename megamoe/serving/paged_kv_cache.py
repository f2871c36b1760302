"""The paged KV cache: one pool of fixed-size blocks per attention layer, and the per-step views that the
attention layers write to and read from.

Why one packed row. Each engine step packs the tokens it computes (every request's prefill chunk or decode
token, in schedule order) into ONE sequence [1, T] with per-token positions, so the model runs once per step,
with no padding (no MLP / MoE work wasted, no expert-load counted for padding). Attention keeps requests
apart as packed training documents are kept apart: each layer's view (:class:`PagedLayerView`, the
:class:`~megamoe.transformer.attention.KVCache` seam) writes this step's entries into their block slots and
returns, for every request in turn, its cached positions followed by the new ones (gathered from its
blocks), with ``packed_segments``: per request, where its queries and its keys lie in the row.
:func:`~megamoe.transformer.attention.packed_attention` then lets each query see only its own request's
keys: the decoding requests (one query each) as one left-padded batch, each prefill chunk in its own call,
so the work is each request's queries times its own keys (one masked call over the whole row, as
transformers' ``sdpa_paged`` does, costs every query times every key of the step: serving 64 requests of
16-128 prompt tokens on a Qwen3-MoE-like model, H 256, 6 layers, on one CPU thread, it took half the time). Each request's queries are the last of its keys, in position order, so the
causal and sliding-window masks of :func:`~megamoe.transformer.attention.causal_attention` are exact, and
attention sinks (gpt-oss) need nothing more.

What a block holds (per layer, as :class:`~megamoe.inference.kv_cache.StaticKVCache` stores them): GQA,
this rank's KV heads' rotated keys and values [kv_heads, block_size, head_dim]; MLA, the normed compressed
latent and the rotated rope key [1, block_size, width]. The pool of a layer is two tensors
[heads, num_blocks * block_size, width] (slot ``block * block_size + offset``); its shapes come from the
attention module's ``kv_cache_shapes()``.

Sliding-window layers read only their window: a request's keys start at ``first query - window + 1``
(so blocks behind every layer's window may be freed, see the scheduler).

Models that mix sliding and full layers in equal numbers with one window and one entry shape (gpt-oss:
alternating): the two kinds get their own block table per request (``block_table`` for the full layers,
``window_table`` for the sliding ones, :attr:`PagedKVCache.split_window`), from ONE pool of block ids whose
storage the kinds share: the k-th full layer and the k-th sliding layer use the same two tensors, at the
slots of their own tables (a block id is in one table only). A block so costs half of all layers' entries,
the blocks of a sequence shorter than the window take what they took in one table, and the sliding
layers' blocks behind their window are released as the request advances (the full layers' stay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from megamoe.transformer.attention import PackedSegments

__all__ = ["PagedKVCache", "PagedLayerView", "PackedKeys", "ScheduledChunk", "attention_layers", "layer_pairs",
           "pack_step"]


def attention_layers(model: nn.Module, layer_ids: Sequence[int]) -> dict[int, nn.Module]:
    """The attention module of each of ``layer_ids`` (decoder layers of ``model.layers``)."""
    return {i: model.layers[str(i)].self_attn for i in layer_ids}


def _window(attention: nn.Module) -> int | None:
    return getattr(attention.config, "sliding_window", None)


def layer_pairs(layers: dict[int, nn.Module]) -> list[tuple[int, int]] | None:
    """(full layer, sliding layer) pairs sharing their pools when ``layers`` mix sliding and full attention in
    equal numbers with one window and one entry shape (see the module docstring); None otherwise."""
    full = [i for i, attention in layers.items() if _window(attention) is None]
    sliding = [i for i, attention in layers.items() if _window(attention) is not None]
    if not full or len(full) != len(sliding) or len({_window(layers[i]) for i in sliding}) != 1:
        return None
    if len({tuple(attention.kv_cache_shapes()) for attention in layers.values()}) != 1:
        return None
    return list(zip(full, sliding))


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's tokens in a step: positions ``[start, start + count)``, in its ``block_table`` (and,
    for the sliding layers of a split cache, its ``window_table``)."""

    block_table: Sequence[int | None]
    start: int
    count: int
    window_table: Sequence[int | None] = ()


@dataclass(frozen=True)
class PackedKeys:
    """How the layers with one sliding window (None: full attention) read the step's keys: the slots to
    gather [K], and per request (first query, queries, first key, keys) among the step's queries and them."""

    gather_slots: torch.Tensor
    segments: PackedSegments


def _ranges(first: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk index, position) of every position of the ranges ``[first[c], first[c] + length[c])``, in order."""
    chunk = torch.repeat_interleave(torch.arange(len(first)), length)
    begin = torch.cumsum(length, 0) - length
    return chunk, first[chunk] + torch.arange(int(length.sum())) - begin[chunk]


def pack_step(chunks: Sequence[ScheduledChunk], block_size: int, windows: set, device,
              split_window: int | None = None) -> tuple[dict, dict]:
    """({window: write slots [T] of the step's tokens}, {window: :class:`PackedKeys`}) for the step's ``chunks``
    (none: an empty step, a data-parallel rank idle while the others work); the layers of window ``split_window``
    (a split cache) use the chunks' ``window_table``. A few vectorized ops over all chunks: a step of hundreds of
    decode chunks spends no Python per position."""
    starts = [chunk.start for chunk in chunks]
    counts = [chunk.count for chunk in chunks]
    start_t, count_t = torch.tensor(starts, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64)

    def flat_tables(tables) -> tuple[torch.Tensor, torch.Tensor]:
        """The block tables the step reads, concatenated, and each chunk's offset in them."""
        flat, offsets = [], []
        for table, start, count in zip(tables, starts, counts):
            offsets.append(len(flat))
            flat.extend(-1 if b is None else b for b in table[:(start + count + block_size - 1) // block_size])
        return torch.tensor(flat, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)

    sources = {False: flat_tables([chunk.block_table for chunk in chunks])}
    if split_window is not None and split_window in windows:
        sources[True] = flat_tables([chunk.window_table for chunk in chunks])

    def slots(source, first: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        flat_t, offsets_t = source
        chunk, positions = _ranges(first, length)
        return flat_t[offsets_t[chunk] + positions // block_size] * block_size + positions % block_size

    queries = (torch.cumsum(count_t, 0) - count_t).tolist()
    writes, packed, written = {}, {}, {}
    for window in windows:
        split = split_window is not None and window == split_window
        if split not in written:
            written[split] = slots(sources[split], start_t, count_t).to(device)
        writes[window] = written[split]
        first = torch.zeros_like(start_t) if window is None else (start_t - window + 1).clamp(min=0)
        length = start_t + count_t - first
        keys = (torch.cumsum(length, 0) - length).tolist()
        segments = list(zip(queries, counts, keys, length.tolist()))
        packed[window] = PackedKeys(slots(sources[split], first, length).to(device),
                                    PackedSegments.build(segments, device))
    return writes, packed


class PagedLayerView:
    """One layer's cache for one step (the attention's KV-cache seam): writes the step's entries, returns
    every scheduled request's keys with their ``packed_segments`` (see the module docstring)."""

    def __init__(self, pools: tuple[torch.Tensor, torch.Tensor], write_slots: torch.Tensor, keys: PackedKeys):
        self.pools, self.write_slots, self.keys = pools, write_slots, keys

    @property
    def packed_segments(self) -> PackedSegments:
        return self.keys.segments

    def update(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``a`` / ``b`` [1, heads, T, width] -> the gathered keys [1, heads, K, width] of both."""
        out = []
        for pool, new in zip(self.pools, (a, b)):
            if new.shape[0] != 1 or new.shape[1] != pool.shape[0] or new.shape[-1] != pool.shape[-1]:
                raise ValueError(f"the paged KV cache holds entries of {pool.shape[0]} heads x {pool.shape[-1]} "
                                 f"features in one packed row, got {tuple(new.shape)}")
            pool.index_copy_(1, self.write_slots, new[0].to(pool.dtype))
            out.append(pool.index_select(1, self.keys.gather_slots)[None].to(new.dtype))
        return out[0], out[1]


class PagedKVCache:
    """The pools of ``layers`` ({layer id: attention module}), ``num_blocks`` blocks of ``block_size``
    positions each, in ``dtype`` on ``device``."""

    def __init__(self, layers: dict[int, nn.Module], num_blocks: int, block_size: int, dtype: torch.dtype, device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.windows = {layer_id: _window(attention) for layer_id, attention in layers.items()}
        pairs = layer_pairs(layers)
        # The sliding layers' window when they have their own block tables (module docstring); None: one table.
        self.split_window = self.windows[pairs[0][1]] if pairs else None
        shared = {sliding: full for full, sliding in pairs or ()}
        slots = num_blocks * block_size
        self.pools = {layer_id: tuple(torch.zeros(heads, slots, width, dtype=dtype, device=device)
                                      for heads, width in attention.kv_cache_shapes())
                      for layer_id, attention in layers.items() if layer_id not in shared}
        for sliding, full in shared.items():
            self.pools[sliding] = self.pools[full]
        self.pools = {layer_id: self.pools[layer_id] for layer_id in layers}          # in layer order

    @staticmethod
    def bytes_per_block(layers: dict[int, nn.Module], block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all ``layers`` (over the full ones only when the sliding ones share their
        storage)."""
        pairs = layer_pairs(layers)
        counted = [full for full, _ in pairs] if pairs else list(layers)
        per_position = sum(heads * width for i in counted for heads, width in layers[i].kv_cache_shapes())
        return per_position * block_size * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        unique = {id(t): t for pair in self.pools.values() for t in pair}
        return sum(t.numel() * t.element_size() for t in unique.values())

    @property
    def common_window(self) -> int | None:
        """The widest sliding window when EVERY layer has one (blocks behind it are dead for all layers);
        None when some layer attends to everything."""
        windows = list(self.windows.values())
        return None if not windows or None in windows else max(windows)

    def views(self, chunks: Sequence[ScheduledChunk]) -> dict[int, PagedLayerView]:
        """Each layer's view of one step over ``chunks``."""
        device = next(iter(self.pools.values()))[0].device
        write_slots, packed = pack_step(chunks, self.block_size, set(self.windows.values()), device,
                                        self.split_window)
        return {layer_id: PagedLayerView(pools, write_slots[self.windows[layer_id]], packed[self.windows[layer_id]])
                for layer_id, pools in self.pools.items()}
