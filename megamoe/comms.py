"""Every collective megamoe issues, in one place, with a call/byte counter.

Conventions
-----------
- ``group=None`` means *a group of one rank*: every function here is then the identity (no
  communication, nothing counted). This is NOT torch.distributed's "None = world" convention: layers
  built without groups are plain single-process modules.
- Functions named ``*_region`` / ``all_to_all`` are autograd functions; their docstrings say what
  happens forward and backward. The others (``all_reduce_``, ``send`` ...) move data without autograd.
- Every collective that moves data is recorded by the active :func:`comm_counter` (if any) with its
  kind, the group's global ranks and the bytes this rank contributes (its input buffer size).
- A collective that times out (the process group's timeout) raises
  :class:`~megamoe.collective_timeout.CollectiveTimeout`, naming the operation, the group's ranks
  and, where the store can tell, the ranks that did not arrive.

Tensor-parallel regions split / gather the LAST dim; sequence-parallel regions the FIRST dim, or the
``dim`` they are given (the model's hidden states are batch-first [B, S, H]: its sequence-parallel
regions pass ``dim=1``).

Uneven first dims. The sequence-parallel gather / reduce-scatter (and :func:`all_gather_into`) take
an optional ``sizes``: every rank's number of rows, in rank order (exchange them with
:func:`all_gather_sizes`). When they differ, each rank's rows are zero-padded to the largest count,
the equal-sized collective runs, and the padding is dropped, so ranks may hold any number of rows,
zero included (e.g. data-parallel attention, where each rank serves its own requests). Equal sizes
take the plain path: same calls, same bytes.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from megamoe.collective_timeout import CollectiveTimeout, is_timeout
from megamoe.host_values import host_ints

__all__ = [
    "CollectiveTimeout", "CommCounter", "comm_counter", "group_size", "group_rank", "group_ranks",
    "all_reduce_", "all_gather_into", "all_gather_sizes", "all_gather_object", "all_to_all_counts", "broadcast_",
    "reduce_scatter_flat", "all_gather_flat", "send", "recv",
    "batch_send_recv", "barrier",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_linears_from_sequence_parallel_region", "all_to_all",
    "exchange_expert_slots",
]


# torch >= 2.13 names them *_single (the *_tensor names warn); older releases only have *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------------------------
# Group helpers
# ----------------------------------------------------------------------------------------------
def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def group_ranks(group: ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of ``group`` (``(global_rank,)`` or ``(0,)`` for ``None``)."""
    if group is None:
        return (dist.get_rank() if dist.is_initialized() else 0,)
    return tuple(dist.get_process_group_ranks(group))


# ----------------------------------------------------------------------------------------------
# Counter
# ----------------------------------------------------------------------------------------------
@dataclass
class CommCounter:
    """Calls and bytes per (collective kind, group ranks), as seen by this rank.

    ``bytes`` counts the payload this rank hands to the collective (its input), which is what the
    tests reason about: an all-reduce of an [T, H] fp32 tensor counts ``T*H*4`` bytes.
    """

    _calls: dict = field(default_factory=lambda: defaultdict(int))
    _bytes: dict = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, group: ProcessGroup | None, nbytes: int) -> None:
        key = (kind, group_ranks(group))
        self._calls[key] += 1
        self._bytes[key] += int(nbytes)

    def _select(self, table: dict, kind: str | None, group: ProcessGroup | Sequence[int] | None) -> int:
        ranks = None
        if group is not None:
            ranks = tuple(group) if isinstance(group, (tuple, list)) else group_ranks(group)
        return sum(v for (k, r), v in table.items()
                   if (kind is None or k == kind) and (ranks is None or r == ranks))

    def calls(self, kind: str | None = None, group=None) -> int:
        """Number of calls, optionally filtered by kind and by group (a ProcessGroup or its ranks)."""
        return self._select(self._calls, kind, group)

    def bytes(self, kind: str | None = None, group=None) -> int:
        """Bytes sent, optionally filtered like :meth:`calls`."""
        return self._select(self._bytes, kind, group)

    def kinds(self) -> dict[str, int]:
        """Calls per kind, for quick assertions and benchmark tables."""
        out: dict[str, int] = defaultdict(int)
        for (k, _), v in self._calls.items():
            out[k] += v
        return dict(out)

    def reset(self) -> None:
        self._calls.clear()
        self._bytes.clear()


_active_counters: list[CommCounter] = []


@contextlib.contextmanager
def comm_counter() -> Iterator[CommCounter]:
    """Count every collective issued inside the block (nested counters all count)."""
    counter = CommCounter()
    _active_counters.append(counter)
    try:
        yield counter
    finally:
        # By identity: list.remove compares with ==, and two counters that saw the same calls are equal.
        del _active_counters[next(i for i, c in enumerate(_active_counters) if c is counter)]


def _record(kind: str, group: ProcessGroup | None, tensor: torch.Tensor) -> None:
    if _active_counters:
        nbytes = tensor.numel() * tensor.element_size()
        for c in _active_counters:
            c.record(kind, group, nbytes)


@contextlib.contextmanager
def _timeout_named(kind: str, group: ProcessGroup | None, peers: Sequence[int] | None = None) -> Iterator[None]:
    """Re-raise a timeout of the torch.distributed call inside as a :class:`CollectiveTimeout`
    naming ``kind`` and the ranks involved: ``group``'s, or for point-to-point operations this
    rank and its ``peers`` (global ranks). Other errors pass unchanged."""
    try:
        yield
    except RuntimeError as e:
        if not is_timeout(e):
            raise
        ranks = tuple(sorted({dist.get_rank(), *peers})) if peers is not None else group_ranks(group)
        raise CollectiveTimeout.diagnose(kind, ranks, e) from e


# ----------------------------------------------------------------------------------------------
# Raw collectives (no autograd)
# ----------------------------------------------------------------------------------------------
def all_reduce_(tensor: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; returns ``tensor``."""
    if group_size(group) == 1:
        return tensor
    _record("all_reduce", group, tensor)
    with _timeout_named("all_reduce", group):
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


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


def all_to_all_counts(send_counts: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Exchange per-destination counts: ``send_counts[r]`` goes to rank r; returns ``recv_counts``.

    The metadata exchange that precedes an uneven :func:`all_to_all`.
    """
    if group_size(group) == 1:
        return send_counts.clone()
    recv_counts = torch.empty_like(send_counts)
    _record("all_to_all", group, send_counts)
    with _timeout_named("all_to_all", group):
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
    return recv_counts


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


def send(tensor: torch.Tensor, dst_global_rank: int, group: ProcessGroup | None = None) -> None:
    """Point-to-point send (pipeline activations / gradients)."""
    _record("send", group, tensor)
    with _timeout_named("send", group, peers=(dst_global_rank,)):
        dist.send(tensor.contiguous(), dst=dst_global_rank, group=group)


def recv(tensor: torch.Tensor, src_global_rank: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Point-to-point receive into ``tensor``; returns it."""
    _record("recv", group, tensor)
    with _timeout_named("recv", group, peers=(src_global_rank,)):
        dist.recv(tensor, src=src_global_rank, group=group)
    return tensor


def barrier(group: ProcessGroup | None) -> None:
    if group_size(group) > 1:
        with _timeout_named("barrier", group):
            dist.barrier(group=group)


# ----------------------------------------------------------------------------------------------
# Autograd functions: tensor parallelism (last dim)
# ----------------------------------------------------------------------------------------------
def _split_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world, rank = group_size(group), group_rank(group)
    if x.shape[-1] % world:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[rank].contiguous()


def _split_first(x: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None = None) -> torch.Tensor:
    world, rank = group_size(group), group_rank(group)
    if sizes is not None:
        return x[sum(sizes[:rank]):sum(sizes[:rank + 1])].contiguous()
    if x.shape[0] % world:
        raise ValueError(f"first dim {x.shape[0]} is not divisible by the sequence-parallel size {world}")
    return x.chunk(world, dim=0)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_into(grad, ctx.group, dim=-1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_into(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce (sum) of the gradient over ``group``.

    Entry of a column-parallel layer: every TP rank consumes the full input, so the input's gradient
    is the sum of the per-rank partial gradients.
    """
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-reduce (sum) over ``group``. Backward: identity.

    Exit of a row-parallel layer: the per-rank partial products are summed.
    """
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-gather the last dim (rank order). Backward: keep this rank's chunk of the gradient."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


# ----------------------------------------------------------------------------------------------
# Autograd functions: sequence parallelism (first dim)
# ----------------------------------------------------------------------------------------------
def _split_seq(x: torch.Tensor, group: ProcessGroup, dim: int, sizes: Sequence[int] | None = None) -> torch.Tensor:
    return _split_first(x.movedim(dim, 0), group, sizes).movedim(0, dim).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup, dim: int, sizes: Sequence[int] | None) -> torch.Tensor:
    return _reduce_scatter_uneven_dim0(x.movedim(dim, 0), group, sizes).movedim(0, dim).contiguous()


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_seq(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_into(grad, ctx.group, dim=ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_grad, sizes, dim):
        ctx.group, ctx.reduce_grad, ctx.sizes, ctx.dim = group, reduce_grad, sizes, dim
        return all_gather_into(x, group, dim=dim, sizes=sizes)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter_seq(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None, None
        return _split_seq(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes, dim):
        ctx.group, ctx.sizes, ctx.dim = group, sizes, dim
        return _reduce_scatter_seq(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_into(grad, ctx.group, dim=ctx.dim, sizes=ctx.sizes), None, None, None


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Forward: keep this rank's chunk of dim ``dim`` (default the first). Backward: all-gather that dim."""
    return x if group_size(group) == 1 else _ScatterToSP.apply(x, group, dim % x.dim())


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None, reduce_grad: bool = True, sizes: Sequence[int] | None = None,
    dim: int = 0,
) -> torch.Tensor:
    """Forward: all-gather dim ``dim`` (default the first; rank order). Backward: reduce-scatter the
    gradient along that dim.

    The reduce-scatter is right when every rank consumes the gathered tensor with *different*
    weights (column-parallel layer after sequence-parallel norm): the input gradient is the sum of
    all ranks' contributions to this rank's rows. With ``reduce_grad=False`` the backward only keeps
    this rank's rows (use when the consumers' gradients are already identical across ranks).
    ``sizes``: every rank's row count when they may differ (see the module docstring).
    ``dim=1``: the model's batch-first [B, S, H] hidden states under sequence parallelism (each rank
    holds a contiguous chunk of the sequence dim); the collective runs on the tensor with ``dim``
    moved first (one copy), so calls and bytes are those of the first-dim region.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSP.apply(x, group, reduce_grad, None if sizes is None else tuple(int(n) for n in sizes),
                               dim % x.dim())


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup | None,
                                               sizes: Sequence[int] | None = None, dim: int = 0) -> torch.Tensor:
    """Forward: reduce-scatter (sum) along dim ``dim`` (default the first). Backward: all-gather that dim.

    Exit of a row-parallel layer under sequence parallelism, and of an all-gather MoE layer whose
    input tokens are sharded across the group. ``sizes``: the rows each rank keeps when they may
    differ (``x`` has ``sum(sizes)`` rows; rank r keeps ``sizes[r]`` of them, in rank order).
    ``dim=1``: the model's [B, S, H] hidden states (see :func:`gather_from_sequence_parallel_region`).
    """
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSP.apply(x, group, None if sizes is None else tuple(int(n) for n in sizes),
                                    dim % x.dim())


class _GatherLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, num, *weights_and_biases):
        weights, biases = weights_and_biases[:num], weights_and_biases[num:]
        full = all_gather_into(x, group, dim=dim)
        ctx.save_for_backward(x, *weights)             # the chunk, not the gathered input
        ctx.group, ctx.dim, ctx.has_bias = group, dim, [b is not None for b in biases]
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = all_gather_into(x, ctx.group, dim=ctx.dim)        # gathered again rather than kept
        flat = full.reshape(-1, full.shape[-1])
        grad_full, grad_weights, grad_biases = None, [], []
        for grad, weight, has_bias in zip(grads, weights, ctx.has_bias):
            if grad is None:
                grad_weights.append(None)
                grad_biases.append(None)
                continue
            grad = grad.reshape(-1, grad.shape[-1])
            part = grad @ weight.to(grad.dtype)                  # [N, in]
            grad_full = part if grad_full is None else grad_full + part
            grad_weights.append((grad.t() @ flat.to(grad.dtype)).to(weight.dtype))
            grad_biases.append(grad.sum(0).to(weight.dtype) if has_bias else None)
        grad_x = None
        if grad_full is not None:
            grad_x = _reduce_scatter_seq(grad_full.view(*full.shape[:-1], -1).to(x.dtype), ctx.group, ctx.dim, None)
        return (grad_x, None, None, None, *grad_weights, *grad_biases)


def gather_linears_from_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None, weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None], dim: int = 0,
) -> list[torch.Tensor]:
    """``[F.linear(full, w, b) for w, b in zip(weights, biases)]`` where ``full`` is ``x`` all-gathered
    along ``dim``: the column-parallel projections entering a sequence-parallel block (q, k, v; gate, up).

    Forward: one all-gather of ``x`` along ``dim``. Backward: the input gradient (the sum of every
    projection's) is reduce-scattered along ``dim``, as :func:`gather_from_sequence_parallel_region`
    does; but only the chunk ``x`` is kept for backward, and the weight gradients need the gathered
    input, so backward all-gathers ``x`` once more (Megatron-LM's sequence-parallel linear does the
    same): 1/tp of the block input's activation memory, for one more all-gather of ``x`` per block.
    Weight and bias gradients are complete locally. One rank (``group=None``): plain ``F.linear``.
    """
    if group_size(group) == 1:
        return [F.linear(x, w, b) for w, b in zip(weights, biases)]
    if len(weights) != len(biases):
        raise ValueError(f"gather_linears: {len(weights)} weights but {len(biases)} biases (None for none)")
    return list(_GatherLinears.apply(x, group, dim % x.dim(), len(weights), *weights, *biases))


# ----------------------------------------------------------------------------------------------
# Autograd function: all-to-all with uneven split sizes (expert parallelism)
# ----------------------------------------------------------------------------------------------
def _all_to_all_raw(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    _record("all_to_all", group, x)
    with _timeout_named("all_to_all", group):
        dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _all_to_all_raw(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        # The transpose of an all-to-all is the all-to-all with the splits swapped.
        return _all_to_all_raw(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: ProcessGroup | None
) -> torch.Tensor:
    """Forward: rows ``x[sum(input_splits[:r]) : ... + input_splits[r]]`` go to rank r; the result
    stacks the rows received from each rank in rank order (``output_splits[r]`` rows from rank r).
    Backward: the same exchange with the splits swapped, returning each row's gradient to its sender.
    Zero-row splits are fine.
    """
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, [int(s) for s in output_splits], [int(s) for s in input_splits], group)


# ----------------------------------------------------------------------------------------------
# Expert migration (online rebalancing)
# ----------------------------------------------------------------------------------------------
def exchange_expert_slots(send_buffer: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                          group: ProcessGroup | None) -> torch.Tensor:
    """The one collective of an expert migration (:func:`megamoe.moe.expert_migration.migrate_layer`),
    one per MoE layer: an all-to-all of raw bytes over the EP group.

    ``send_buffer`` is a 1-D uint8 tensor holding, destination rank after destination rank
    (``send_sizes[r]`` bytes for rank r), the packed payloads of the expert slots this rank sends: each
    payload is one slot's weights, its optimizer state (Adam moments, master weights) and its FP8 scaling
    rows, all in their own dtypes, as bytes (so that one collective carries them all). Returns the bytes
    received, source rank after source rank (``recv_sizes[r]`` from rank r). Counted as kind
    ``"expert_slot_exchange"`` (its own kind, to tell migration traffic from token dispatch) with the
    bytes this rank sends: summed over the group, the migration's whole volume. No autograd.
    """
    world = group_size(group)
    if send_buffer.dtype != torch.uint8 or send_buffer.dim() != 1:
        raise ValueError(f"exchange_expert_slots: send_buffer must be a 1-D uint8 tensor (packed bytes), got "
                         f"{send_buffer.dtype} of shape {tuple(send_buffer.shape)}")
    if len(send_sizes) != world or len(recv_sizes) != world or sum(send_sizes) != send_buffer.numel():
        raise ValueError(f"exchange_expert_slots: send_sizes {list(send_sizes)} and recv_sizes {list(recv_sizes)} "
                         f"must give one byte count per rank of the group ({world}), send_sizes summing to the "
                         f"buffer's {send_buffer.numel()} bytes")
    if world == 1:
        return send_buffer
    out = send_buffer.new_empty(sum(int(n) for n in recv_sizes))
    _record("expert_slot_exchange", group, send_buffer)
    with _timeout_named("expert_slot_exchange", group):
        dist.all_to_all_single(out, send_buffer.contiguous(), output_split_sizes=[int(n) for n in recv_sizes],
                               input_split_sizes=[int(n) for n in send_sizes], group=group)
    return out


# ----------------------------------------------------------------------------------------------
# Batched point-to-point (pipeline parallelism)
# ----------------------------------------------------------------------------------------------
def batch_send_recv(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: ProcessGroup | None,
) -> list[torch.Tensor]:
    """Post every send ``(tensor, dst_global_rank)`` and receive ``(buffer, src_global_rank)`` of this
    rank at once, then wait for all of them; returns the receive buffers (filled in place), in order.

    Why batched: two neighbouring pipeline stages often exchange in both directions at the same
    moment (activation one way, gradient the other). With blocking ``send`` then ``recv`` on both
    sides, each waits for the other's receive (gloo) and they deadlock; posting everything before
    waiting cannot. Messages between the same pair of ranks in the same direction are matched in
    the order they are posted, on both sides.

    Peers are GLOBAL ranks that belong to ``group``. Each send counts as one "send" (its bytes) and
    each receive as one "recv" (the buffer's bytes), both keyed by ``group``. ``group=None`` is one
    rank: only empty lists are accepted (there is nobody to talk to).
    """
    if not sends and not recvs:
        return []
    if group_size(group) == 1:
        raise ValueError(
            "batch_send_recv: group has one rank (None), so there is no peer; pass the pipeline's "
            "process group, or no sends/recvs"
        )
    ops = []
    for tensor, dst in sends:
        _record("send", group, tensor)
        ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), peer=dst, group=group))
    for buffer, src in recvs:
        if not buffer.is_contiguous():
            raise ValueError("batch_send_recv: receive buffers must be contiguous (received in place)")
        _record("recv", group, buffer)
        ops.append(dist.P2POp(dist.irecv, buffer, peer=src, group=group))
    peers = [dst for _, dst in sends] + [src for _, src in recvs]
    with _timeout_named("batch_send_recv", group, peers=peers):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return [buffer for buffer, _ in recvs]
