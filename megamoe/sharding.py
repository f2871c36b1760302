"""How a local parameter relates to its logical (unsharded) tensor.

Every parallel layer tags its parameters with a :class:`ShardSpec`. Checkpoints use it to save the
logical shape and offsets of each local chunk, initialisation uses it to slice one full, seeded
tensor (so the same seed gives the same model whatever the layout), and gradient clipping uses it
to avoid counting replicated parameters more than once.

A second tag, ``param.sequence_parallel = True``, marks parameters that are replicated over the TP
group but see only this rank's tokens under sequence parallelism (row-parallel biases, norms): their
gradients must be all-reduced over TP (see
:func:`megamoe.tensor_parallel.allreduce_sequence_parallel_grads`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ShardSpec", "set_shard_spec", "get_shard_spec"]


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
