"""How attention heads (and every per-head tensor) are split over a tensor-parallel group.

A dim made of ``num_heads`` equal head blocks is cut into ``count = min(tp, num_heads)`` shards:

- ``num_heads % tp == 0``: rank ``r`` holds shard ``r`` (``num_heads / tp`` consecutive heads);
- ``tp % num_heads == 0`` (more ranks than heads, e.g. 8-way TP over 4 KV heads): rank ``r`` holds
  head ``r // (tp / num_heads)``, i.e. each head is *replicated* on ``tp / num_heads`` consecutive
  ranks — exactly the KV head that the rank's query heads use in grouped-query attention.

A replicated shard gets a different partial gradient on each of its ranks (each rank uses it for
its own query heads only); :func:`sum_grad_over_replicas` sums them inside autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.sharding import ShardSpec

__all__ = ["HeadShard", "head_shard", "sum_grad_over_replicas"]


@dataclass(frozen=True)
class HeadShard:
    """This rank holds shard ``index`` of ``count`` equal shards; each shard lives on ``replicas`` ranks."""

    index: int
    count: int
    replicas: int

    def spec(self, global_shape: tuple[int, ...], dim: int = 0) -> ShardSpec:
        """The spec of a tensor split along ``dim`` this way (replicated when there is one shard)."""
        if self.count == 1:
            return ShardSpec(tuple(global_shape))
        return ShardSpec(tuple(global_shape), dim, self.index, self.count)


def head_shard(tp_group: ProcessGroup | None, num_heads: int, what: str) -> HeadShard:
    """The shard of ``num_heads`` heads this rank holds; ``what`` names the head count in errors."""
    tp, rank = comms.group_size(tp_group), comms.group_rank(tp_group)
    if num_heads % tp == 0:
        return HeadShard(rank, tp, 1)
    if tp % num_heads == 0:
        replicas = tp // num_heads
        return HeadShard(rank // replicas, num_heads, replicas)
    raise ValueError(f"{what} ({num_heads}) must be a multiple or a divisor of the tensor-parallel size ({tp})")


def sum_grad_over_replicas(local: torch.Tensor, spec: ShardSpec, tp_group: ProcessGroup | None,
                           replicas: int) -> torch.Tensor:
    """Forward: ``local`` (the shard ``spec`` describes). Backward: its gradient summed over the
    ``replicas`` ranks of ``tp_group`` holding the same shard, so replicated shards get complete
    gradients from autograd alone.

    How: the shard is zero-padded to the logical shape, passed through
    ``copy_to_tensor_parallel_region`` (backward: all-reduce over TP, where every rank contributes
    only its own shard's rows) and narrowed back. Cost: one all-reduce of the LOGICAL tensor per
    backward, acceptable for the small k/v projections and norms that need it.
    """
    if replicas == 1:
        return local
    if spec.dim is None:                  # one shard (a single KV head): every rank of the group holds it
        return comms.copy_to_tensor_parallel_region(local, tp_group)
    lo = spec.offsets[spec.dim]
    hi = spec.global_shape[spec.dim] - lo - local.shape[spec.dim]
    pad = [0, 0] * (local.dim() - 1 - spec.dim) + [lo, hi]      # F.pad lists dims from the last one
    full = comms.copy_to_tensor_parallel_region(F.pad(local, pad), tp_group)
    return full.narrow(spec.dim, lo, local.shape[spec.dim])
