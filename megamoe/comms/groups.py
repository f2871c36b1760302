"""Group helpers: size, rank and global ranks of a process group, where ``None`` is a group of one rank."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def group_ranks(group: ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of ``group`` (``(global_rank,)`` or ``(0,)`` for ``None``)."""
    if group is None:
        return (dist.get_rank() if dist.is_initialized() else 0,)
    return tuple(dist.get_process_group_ranks(group))
