"""How a local parameter relates to its logical (unsharded) tensor.

Every parallel layer tags its parameters with a :class:`ShardSpec`. Checkpoints use it to save the
logical shape and offsets of each local chunk, initialisation uses it to slice one full, seeded
tensor (so the same seed gives the same model whatever the layout), and gradient clipping uses it
to avoid counting replicated parameters more than once.

A parameter a user adds to a parallel layer is untagged, hence taken as replicated: if each rank
holds a different piece of it, declare that in one line with :func:`shard_parameter`, e.g. a gate on
a column-parallel layer's local output features::

    self.gate = shard_parameter(nn.Parameter(torch.ones(self.out_features_per_rank)), dim=0, group=tp_group)

Otherwise a checkpoint stores it as one replicated tensor, and the save refuses the ranks' differing
copies.

A second tag, ``param.sequence_parallel = True``, marks parameters that are replicated over the TP
group but see only this rank's tokens under sequence parallelism (row-parallel biases, norms, routers;
the full list in :mod:`megamoe.models.sequence_parallel`): their gradients must be all-reduced over TP
(the gradient sync does; :func:`megamoe.tensor_parallel.allreduce_sequence_parallel_grads` for a module
of one's own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from megamoe import comms

__all__ = ["ShardSpec", "set_shard_spec", "get_shard_spec", "shard_parameter"]


@dataclass(frozen=True)
class ShardSpec:
    """A local tensor is chunk ``index`` of ``count`` equal chunks of ``global_shape`` along ``dim``
    (``dim=None``: the local tensor is the whole logical tensor, replicated)."""

    global_shape: tuple[int, ...]
    dim: int | None = None
    index: int = 0
    count: int = 1

    def __post_init__(self):
        if self.dim is None:
            if self.count != 1:
                raise ValueError(f"ShardSpec: a replicated tensor (dim=None) has count 1, got {self.count}")
            return
        if not 0 <= self.dim < len(self.global_shape):
            raise ValueError(f"ShardSpec.dim {self.dim} out of range for shape {self.global_shape}")
        if self.global_shape[self.dim] % self.count:
            raise ValueError(
                f"ShardSpec: dim {self.dim} of size {self.global_shape[self.dim]} is not divisible into "
                f"{self.count} shards")
        if not 0 <= self.index < self.count:
            raise ValueError(f"ShardSpec.index {self.index} not in [0, {self.count})")

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] //= self.count
        return tuple(shape)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Offset of the local chunk in the logical tensor, per dim."""
        off = [0] * len(self.global_shape)
        if self.dim is not None:
            off[self.dim] = self.index * self.local_shape[self.dim]
        return tuple(off)

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the logical tensor ``full`` (a view)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"expected the logical shape {self.global_shape}, got {tuple(full.shape)}")
        if self.dim is None:
            return full
        return full.chunk(self.count, dim=self.dim)[self.index]


def set_shard_spec(param: torch.Tensor, spec: ShardSpec) -> None:
    if tuple(param.shape) != spec.local_shape:
        raise ValueError(f"parameter shape {tuple(param.shape)} does not match the shard {spec.local_shape}")
    param.shard_spec = spec


def get_shard_spec(param: torch.Tensor) -> ShardSpec:
    """The parameter's spec; untagged parameters are replicated."""
    return getattr(param, "shard_spec", None) or ShardSpec(tuple(param.shape))


def shard_parameter(param: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Declare ``param`` this rank's chunk of a logical tensor split into equal chunks along ``dim``
    over ``group``, in rank order (rank r holds chunk r; the logical size of ``dim`` is the local one
    times the group size). Returns ``param``, tagged, so that the declaration fits in the assignment.

    Checkpoints then save the logical tensor (and reload it under another group size), and the global
    gradient norm counts the chunk once instead of as a copy replicated over ``group``. ``group=None``
    (one process) declares the whole tensor.
    """
    if param.dim() == 0:
        raise ValueError("shard_parameter: a 0-dim tensor has no dim to split; leave it replicated")
    if not -param.dim() <= dim < param.dim():
        raise ValueError(f"shard_parameter: dim {dim} is out of range for a tensor of shape {tuple(param.shape)}")
    dim %= param.dim()
    size, rank = comms.group_size(group), comms.group_rank(group)
    global_shape = list(param.shape)
    global_shape[dim] *= size
    set_shard_spec(param, ShardSpec(tuple(global_shape), dim, rank, size))
    return param
