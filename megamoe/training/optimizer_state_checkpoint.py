"""Checkpoints of :class:`~megamoe.training.distributed_optimizer.DistributedOptimizer`'s sharded state.

Each bucket's state is sharded over its group; a checkpoint holds it in full shape (the plain optimizer's
logical layout, so any layout can read it). Saving gathers ONE bucket at a time and copies it out to host
buffers (rank ``index % N`` of the bucket's group writes it); loading reads, bucket by bucket, only the
rows of this rank's shards. The device therefore never holds the full state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from megamoe import comms
from megamoe.checkpoint_state import LogicalChunk
from megamoe.host_staging import host_buffer

__all__ = ["ShardedStateCheckpointing"]


@dataclass
class _LogicalState:
    """Full-shape (logical) optimizer state of some parameters, in host memory, the stand-in for the plain
    optimizer that :func:`megamoe.checkpoint_state.optimizer_chunks` reads: ``param_groups`` (those
    parameters only) and ``state[param] = {"exp_avg", "exp_avg_sq": fp32 shaped like param, "step": 0-dim}``.
    ``masters[param]``: the fp32 master weights shaped like the parameter (non-fp32 parameters only), saved
    as the weights."""
    param_groups: list
    state: dict
    masters: dict


class ShardedStateCheckpointing:
    """The checkpoint methods of the distributed optimizer (a mixin: it reads the optimizer's ``_buckets``,
    ``_entries``, ``state``, ``param_groups``, ``device``, ``materialize_state`` and ``_state_of``)."""

    def _written_here(self, index: int) -> bool:
        """Whether this rank writes bucket ``index``'s state to a checkpoint: rank ``index % N`` of the
        bucket's group does (its other ranks hold the same gathered values), spreading the writes."""
        group = self._buckets[index].group
        return index % group.size == group.rank

    def _logical_part(self, buckets, full: dict, masters: dict) -> _LogicalState:
        params = {e.param for b in buckets for e in b.entries}
        groups = [{**g, "params": [p for p in g["params"] if p in params]} for g in self.param_groups]
        return _LogicalState([g for g in groups if g["params"]], full, masters)

    @torch.no_grad()
    def logical_state(self) -> _LogicalState:
        """Full-shape state, in host memory, of the parameters whose state this rank writes (see
        :class:`_LogicalState`; the buckets of :meth:`_written_here`). Collective: one all-gather per
        bucket and state key over the bucket's group, every rank taking part; each gathered bucket is
        copied out to host buffers parameter by parameter and dropped before the next is gathered, so the
        device holds at most one bucket's gathered state (plus its shard, and one parameter's reordering)
        on top of the optimizer's own, never the full state."""
        self.materialize_state()
        full: dict = {}
        masters: dict = {}
        written = []
        for index, bucket in enumerate(self._buckets):
            size, mine = bucket.group.size, self._written_here(index)
            keys = sorted(k for k in self.state[bucket.entries[0].param] if k != "step")
            for key in keys:
                flat = torch.cat([self.state[e.param][key].reshape(-1) for e in bucket.entries])
                gathered = comms.all_gather_flat(flat, bucket.group.group)
                del flat
                for e in bucket.entries if mine else ():
                    value = host_buffer(e.param.shape, torch.float32, staging_for=self.device)
                    value.copy_(e.full_from(gathered, size, bucket.shard_numel))
                    if key == "master":
                        masters[e.param] = value
                    else:
                        full.setdefault(e.param, {})[key] = value
                del gathered       # before the next one is gathered: one bucket's at a time on the device
            if mine:
                written.append(bucket)
                for e in bucket.entries:
                    step = self.state[e.param]["step"]
                    full[e.param]["step"] = host_buffer((), step.dtype, staging_for=step.device).copy_(step)
        return self._logical_part(written, full, masters)

    @torch.no_grad()
    def logical_state_buckets(self, *, planning: bool = False) -> Iterator[_LogicalState]:
        """Zero full-shape state, bucket by bucket, of every parameter of this rank: in host buffers to read a
        checkpoint's state into, each bucket then taken by :meth:`load_logical_state` before the next is
        made (host memory: one bucket's state at a time); ``planning``: on the meta device (no storage), to
        plan which files the reads need. Creates the state first (zeros, step 0)."""
        self.materialize_state()
        for bucket in self._buckets:
            full: dict = {}
            masters: dict = {}
            for e in bucket.entries:
                for key, shard in self.state[e.param].items():
                    shape = () if key == "step" else e.param.shape
                    value = (torch.empty(shape, dtype=shard.dtype, device="meta") if planning else
                             host_buffer(shape, shard.dtype, staging_for=shard.device).zero_())
                    if key == "master":
                        masters[e.param] = value
                    else:
                        full.setdefault(e.param, {})[key] = value
            yield self._logical_part([bucket], full, masters)

    def owned_chunks(self, chunks: list[LogicalChunk], logical: _LogicalState) -> list[LogicalChunk]:
        """Of ``chunks``, views of ``logical``'s host tensors (a part of :meth:`logical_state_buckets`), the
        dim-0 slices that hold this rank's columns (:meth:`ShardEntry.owned_rows`): what a rank reads of a
        checkpoint's state, about 1/N of it; the rest of each tensor, which it never uses, stays unread."""
        owner = {}
        for p, values in [*logical.state.items(), *((p, {"master": v}) for p, v in logical.masters.items())]:
            for value in values.values():
                if value.dim():
                    owner[value.untyped_storage().data_ptr()] = (p, value)
        owned = []
        for chunk in chunks:
            if not chunk.tensor.dim():
                owned.append(chunk)
                continue
            param, base = owner[chunk.tensor.untyped_storage().data_ptr()]
            rows = self._entries[param].owned_rows(chunk.tensor, base)
            if rows is not None:
                lo, hi = rows
                owned.append(LogicalChunk(chunk.name, chunk.tensor[lo:hi], chunk.global_shape,
                                          (chunk.offsets[0] + lo, *chunk.offsets[1:])))
        return owned

    @torch.no_grad()
    def load_logical_state(self, logical: _LogicalState) -> None:
        """Take this rank's shards of the loaded full-shape state of the parameters ``logical`` holds (only
        this rank's columns need to have been read, :meth:`owned_chunks`); the parameters themselves are
        loaded as the model's weights. Device memory beyond the shards: at most one parameter's columns in
        transit."""
        for p, values in logical.state.items():
            e = self._entries[p]
            s = self._state_of(e)
            for key, value in values.items():
                if key == "step":
                    s["step"].copy_(value)
                else:
                    s[key].zero_()
                    s[key][:, :e.valid].copy_(e.owned(value))
            if p in logical.masters:
                s["master"].zero_()
                s["master"][:, :e.valid].copy_(e.owned(logical.masters[p]))
