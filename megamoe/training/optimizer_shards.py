"""How the distributed optimizer lays parameters out in shards and buckets
(:mod:`megamoe.training.distributed_optimizer`).

Every parameter is sharded on its own: viewed as [rows, row_numel] (one row, or one row per expert slot for
parameters stacked by slot), each of the N ranks of its group owns ``cols = ceil(row_numel / N)`` columns of
every row (the last rank's possibly partly padding). A bucket holds the [rows, cols] pieces of several
parameters of one (group, dtype, expert, chunk) after each other: its reduce-scatter input is [N, shard_numel]
and this rank's shard is [shard_numel].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megamoe.moe.moe_layer import MoELayer

__all__ = ["ShardGroup", "ShardEntry", "ShardBucket", "stacked_slot_rows"]


@dataclass(frozen=True)
class ShardGroup:
    """The group a parameter is sharded over (``group`` None for one rank)."""
    group: object
    size: int
    rank: int


@dataclass
class ShardEntry:
    """Where one parameter lives: viewed as [rows, row_numel], this rank owns columns
    [rank * cols, rank * cols + valid) of every row, at ``offset`` in its bucket's chunk."""
    param: nn.Parameter
    rows: int
    row_numel: int
    cols: int
    rank: int
    expert: bool
    bucket: int = -1
    offset: int = 0
    grad_offset: int = 0        # where its ``main_grad`` starts in the bucket's fp32 accumulation buffer

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def valid(self) -> int:
        return max(0, min(self.cols, self.row_numel - self.rank * self.cols))

    def owned(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's columns of ``tensor`` (shaped like the parameter): a [rows, valid] view."""
        start = self.rank * self.cols
        return tensor.view(self.rows, self.row_numel)[:, start:start + self.valid]

    def owned_rows(self, view: torch.Tensor, base: torch.Tensor) -> tuple[int, int] | None:
        """The range ``[lo, hi)`` of dim 0 of ``view`` (a view of ``base``, a tensor shaped and strided like
        the parameter) whose elements include all of this rank's columns in ``view``; None when there are
        none. A dim-0 slice spanning a row boundary of the [rows, row_numel] view counts as holding some (a
        few elements more than needed may be read, never fewer)."""
        if self.valid <= 0 or not view.numel():
            return None
        first = view.storage_offset() - base.storage_offset()
        inner = sum((size - 1) * stride for size, stride in zip(view.shape[1:], view.stride()[1:]))
        a = first + torch.arange(view.shape[0], dtype=torch.int64) * view.stride(0)   # flat extent [a, b] of
        b = a + inner                                                                  # each dim-0 slice
        row = a // self.row_numel
        owned_start = row * self.row_numel + self.rank * self.cols
        meets = (b // self.row_numel != row) | ((torch.maximum(a, owned_start) <
                                                 torch.minimum(b + 1, owned_start + self.valid)))
        index = meets.nonzero().flatten()
        return None if not index.numel() else (int(index[0]), int(index[-1]) + 1)

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's [rows, cols] piece of a bucket's [shard_numel] buffer."""
        return flat[self.offset:self.offset + self.numel].view(self.rows, self.cols)

    def full_from(self, gathered: torch.Tensor, size: int, shard_numel: int) -> torch.Tensor:
        """The parameter-shaped tensor from a bucket's gathered [size * shard_numel] buffer."""
        pieces = gathered.view(size, shard_numel)[:, self.offset:self.offset + self.numel]
        rows = pieces.reshape(size, self.rows, self.cols).transpose(0, 1).reshape(self.rows, size * self.cols)
        return rows[:, :self.row_numel].reshape(self.param.shape)


@dataclass
class ShardBucket:
    group: ShardGroup
    dtype: torch.dtype
    expert: bool
    entries: list[ShardEntry] = field(default_factory=list)
    shard_numel: int = 0
    grad_shard: torch.Tensor | None = None     # [shard_numel] fp32, reduced; from reduce_gradients to the step
    # fp32 gradient accumulation (non-fp32 parameters): [grad_numel] fp32, parameter after parameter, the
    # storage of the parameters' ``main_grad`` views; from the step's first gradient to zero_grad (ZeRO-2:
    # to reduce_gradients).
    accumulate_fp32: bool = False
    grad_numel: int = 0
    main_grad: torch.Tensor | None = None
    chunk: int = 0              # the model chunk of its parameters (virtual pipeline)
    deferred: bool = False      # reduced after GradientSync's sums, never from a backward hook


def stacked_slot_rows(model: nn.Module) -> dict[int, int]:
    """id(param) -> number of slot rows, for expert parameters stacked by slot ([S, ...])."""
    rows: dict[int, int] = {}
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        slot_parameters = getattr(layer.experts, "slot_parameters", None)
        if slot_parameters is None:
            continue
        for param, index in slot_parameters(0):
            if isinstance(index, int):
                rows[id(param)] = param.shape[0]
    return rows
