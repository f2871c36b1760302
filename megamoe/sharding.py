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
    (``dim=None``: the local tensor is the whole logical tensor, replicated).

    ``padded_size`` (the vocabulary rows of the embedding and output layer,
    :mod:`megamoe.tensor_parallel.vocab_padding`): ``dim`` is padded to that size before the split, so
    the local tensor is chunk ``index`` of the PADDED tensor, and its rows at and beyond
    ``global_shape[dim]`` are padding: not part of the logical tensor, never saved. :attr:`logical_shape`
    and :attr:`offsets` describe the real rows only; :meth:`logical_part` is their view of the local tensor.
    """

    global_shape: tuple[int, ...]
    dim: int | None = None
    index: int = 0
    count: int = 1
    padded_size: int | None = None

    def __post_init__(self):
        if self.dim is None:
            if self.count != 1:
                raise ValueError(f"ShardSpec: a replicated tensor (dim=None) has count 1, got {self.count}")
            if self.padded_size is not None:
                raise ValueError("ShardSpec: padded_size pads the split dim; a replicated tensor (dim=None) has none")
            return
        if not 0 <= self.dim < len(self.global_shape):
            raise ValueError(f"ShardSpec.dim {self.dim} out of range for shape {self.global_shape}")
        size = self.global_shape[self.dim]
        if self.padded_size is not None and (self.padded_size < size or self.padded_size % self.count):
            raise ValueError(f"ShardSpec.padded_size {self.padded_size} must be >= the logical size {size} of dim "
                             f"{self.dim} and divisible into {self.count} shards")
        if self.padded_size is None and size % self.count:
            raise ValueError(
                f"ShardSpec: dim {self.dim} of size {size} is not divisible into {self.count} shards")
        if not 0 <= self.index < self.count:
            raise ValueError(f"ShardSpec.index {self.index} not in [0, {self.count})")

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The local tensor's shape (padding rows included)."""
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] = self._split_size // self.count
        return tuple(shape)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The shape of the local tensor's real part (:meth:`logical_part`): ``local_shape`` less padding."""
        if self.dim is None:
            return self.global_shape
        shape = list(self.local_shape)
        shape[self.dim] = max(0, min(shape[self.dim], self.global_shape[self.dim] - self._start))
        return tuple(shape)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Offset of the local chunk's real part in the logical tensor, per dim."""
        off = [0] * len(self.global_shape)
        if self.dim is not None:
            off[self.dim] = min(self._start, self.global_shape[self.dim])
        return tuple(off)

    @property
    def _split_size(self) -> int:
        return self.padded_size if self.padded_size is not None else self.global_shape[self.dim]

    @property
    def _start(self) -> int:
        return self.index * (self._split_size // self.count)

    def logical_part(self, local: torch.Tensor) -> torch.Tensor:
        """The real rows of the local tensor ``local`` (a view; ``local`` itself without padding)."""
        if self.dim is None or self.padded_size is None:
            return local
        return local.narrow(self.dim, 0, self.logical_shape[self.dim])

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """The part of the logical tensor ``full`` this rank holds (a view, shaped :attr:`logical_shape`)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"expected the logical shape {self.global_shape}, got {tuple(full.shape)}")
        if self.dim is None:
            return full
        return full.narrow(self.dim, self.offsets[self.dim], self.logical_shape[self.dim])


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
