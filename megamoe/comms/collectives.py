"""Raw collectives (no autograd): all-reduce (and ``any_rank``: of one flag), all-gather (even or uneven first
dims), reduce-scatter, the flat reduce-scatter / all-gather of the distributed optimizer, object all-gather,
broadcast, barrier."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megamoe.comms.counter import _active_counters, _record, _timeout_named
from megamoe.comms.groups import group_rank, group_size
from megamoe.host_values import host_ints


# torch >= 2.13 names them *_single (the *_tensor names warn); older releases only have *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_(tensor: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; returns ``tensor``."""
    if group_size(group) == 1:
        return tensor
    _record("all_reduce", group, tensor)
    with _timeout_named("all_reduce", group):
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def any_rank(flag: bool, group: ProcessGroup | None, device=None) -> bool:
    """True when ``flag`` is True on any rank of ``group``: ONE all-reduce (MAX) of one int64 on ``device``,
    counted as ``"all_reduce"``. The serving engine's data-parallel ranks agree this way, every step, whether
    any of them has work (then all run the model together: their MoE all-to-alls must match)."""
    if group_size(group) == 1:
        return bool(flag)
    busy = torch.tensor([int(bool(flag))], dtype=torch.int64, device=device)
    return host_ints(all_reduce_(busy, group, op=dist.ReduceOp.MAX), on_meta=[1])[0] > 0


def all_reduce_coalesced_(tensors: Sequence[torch.Tensor], group: ProcessGroup | None) -> None:
    """Sum each of ``tensors`` over ``group`` in place with ONE all-reduce of their flat concatenation
    (same dtype and device), instead of one call per tensor."""
    if not tensors or group_size(group) == 1:
        return
    flat = all_reduce_(torch.cat([t.reshape(-1) for t in tensors]), group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def all_gather_into(tensor: torch.Tensor, group: ProcessGroup | None, dim: int = 0,
                    sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along ``dim`` (rank order). The shapes must be equal,
    except along ``dim`` when ``sizes`` (every rank's length of ``dim``) is given."""
    world = group_size(group)
    if world == 1:
        return tensor
    src = tensor.movedim(dim, 0)
    if sizes is not None:
        _check_sizes(sizes, src.shape[0], group)
        longest = max(sizes)
        if longest == 0:
            return tensor
        if min(sizes) != longest:
            gathered = _all_gather_dim0(_pad_rows(src, longest), group).split(longest)
            return torch.cat([block[:n] for block, n in zip(gathered, sizes)]).movedim(0, dim)
    return _all_gather_dim0(src, group).movedim(0, dim)


def _all_gather_dim0(src: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    src = src.contiguous()
    _record("all_gather", group, src)
    out = torch.empty((group_size(group) * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
    with _timeout_named("all_gather", group):
        _all_gather_single(out, src, group=group)
    return out


def all_gather_sizes(num_rows: int, group: ProcessGroup | None, device=None) -> list[int]:
    """Every rank's ``num_rows``, in rank order: the metadata exchange (one all-gather of one int64)
    that precedes a gather or reduce-scatter of uneven first dims."""
    if group_size(group) == 1:
        return [int(num_rows)]
    sizes = all_gather_into(torch.tensor([int(num_rows)], dtype=torch.int64, device=device), group)
    return host_ints(sizes, on_meta=[int(num_rows)] * group_size(group))    # meta: every rank as many as this one


def _check_sizes(sizes: Sequence[int], num_rows: int, group: ProcessGroup) -> None:
    if len(sizes) != group_size(group) or sizes[group_rank(group)] != num_rows:
        raise ValueError(f"sizes {list(sizes)} must list the rows of each of the {group_size(group)} ranks, this "
                         f"rank's entry ({group_rank(group)}) being its own row count {num_rows}")


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` [n, ...] zero-padded to [rows, ...]."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def _reduce_scatter_uneven_dim0(tensor: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None):
    """Sum over ranks of ``tensor`` [sum(sizes), ...]; rank r keeps its block of ``sizes[r]`` rows
    (blocks in rank order; equal blocks when ``sizes`` is None)."""
    if sizes is None:
        return _reduce_scatter_dim0(tensor, group)
    if len(sizes) != group_size(group) or sum(sizes) != tensor.shape[0]:
        raise ValueError(f"reduce-scatter: sizes {list(sizes)} must give one row count per rank of the group "
                         f"({group_size(group)}) and sum to the first dim {tensor.shape[0]}")
    longest = max(sizes)
    if longest == 0:
        return tensor
    if min(sizes) == longest:
        return _reduce_scatter_dim0(tensor, group)
    padded = torch.cat([_pad_rows(block, longest) for block in tensor.split(list(sizes))])
    return _reduce_scatter_dim0(padded, group)[:sizes[group_rank(group)]]


def _reduce_scatter_dim0(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    if tensor.shape[0] % world:
        raise ValueError(f"reduce-scatter: first dim {tensor.shape[0]} is not divisible by the group size {world}")
    _record("reduce_scatter", group, tensor)
    src = tensor.contiguous()
    out = torch.empty((src.shape[0] // world, *src.shape[1:]), dtype=src.dtype, device=src.device)
    with _timeout_named("reduce_scatter", group):
        _reduce_scatter_single(out, src, group=group)
    return out


def reduce_scatter_flat(buffer: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum a 1-D buffer [N * k] over the group's N ranks; rank r gets the sum of elements
    [r * k, (r + 1) * k) (a new [k] tensor). The distributed optimizer's gradient reduction, one call
    per bucket (:mod:`megamoe.training.distributed_optimizer`); no autograd. Counted as
    ``"reduce_scatter"`` with the whole input buffer's bytes (N * k elements): as many as an all-reduce of
    the same buffer counts. One rank: the buffer itself."""
    if buffer.dim() != 1:
        raise ValueError(f"reduce_scatter_flat: the buffer must be 1-D, got shape {tuple(buffer.shape)}")
    if group_size(group) == 1:
        return buffer
    return _reduce_scatter_dim0(buffer, group)


def all_gather_flat(shard: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's 1-D ``shard`` [k] in rank order: a new [N * k] tensor. The distributed
    optimizer's parameter all-gather after its step, one call per bucket; no autograd. Counted as
    ``"all_gather"`` with this rank's input bytes (k elements): N times that is the gathered buffer, the
    bytes an all-reduce of it counts. One rank: the shard itself."""
    if shard.dim() != 1:
        raise ValueError(f"all_gather_flat: the shard must be 1-D, got shape {tuple(shard.shape)}")
    if group_size(group) == 1:
        return shard
    return _all_gather_dim0(shard, group)


def all_gather_object(obj, group: ProcessGroup | None) -> list:
    """Gather a small picklable Python object (metadata only, never tensors of data) from every rank."""
    if group_size(group) == 1:
        return [obj]
    out = [None] * group_size(group)
    if _active_counters:
        for c in _active_counters:
            c.record("all_gather_object", group, 0)
    with _timeout_named("all_gather_object", group):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_(tensor: torch.Tensor, src_global_rank: int, group: ProcessGroup | None) -> torch.Tensor:
    if group_size(group) == 1:
        return tensor
    _record("broadcast", group, tensor)
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()   # gloo needs dense buffers
    with _timeout_named("broadcast", group):
        dist.broadcast(buffer, src=src_global_rank, group=group)
    if buffer is not tensor:
        tensor.copy_(buffer)
    return tensor


def barrier(group: ProcessGroup | None) -> None:
    if group_size(group) > 1:
        with _timeout_named("barrier", group):
            dist.barrier(group=group)
