"""The all-to-all exchanges of expert parallelism: the per-destination counts, the token all-to-all
with uneven split sizes (autograd), and the byte exchange of an expert migration (online rebalancing)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megamoe.comms.counter import _record, _timeout_named
from megamoe.comms.groups import group_size
from megamoe.comms.timeline import record_event


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


# ----------------------------------------------------------------------------------------------
# Autograd function: all-to-all with uneven split sizes (expert parallelism)
# ----------------------------------------------------------------------------------------------
def _all_to_all_raw(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
                    tag: str | None = None) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    _record("all_to_all", group, x)
    if tag is not None:
        # A blocking exchange is blocked from issue to return: on a timeline it is an issue followed at once
        # by the wait, so that blocked_seconds(tag) compares with the asynchronous path's.
        record_event("all_to_all", "issue", tag)
        record_event("all_to_all", "wait_start", tag)
    with _timeout_named("all_to_all", group):
        dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=group)
    if tag is not None:
        record_event("all_to_all", "wait", tag)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, tag):
        ctx.group, ctx.output_splits, ctx.input_splits, ctx.tag = group, output_splits, input_splits, tag
        return _all_to_all_raw(x, output_splits, input_splits, group, tag)

    @staticmethod
    def backward(ctx, grad):
        # The transpose of an all-to-all is the all-to-all with the splits swapped.
        return _all_to_all_raw(grad, ctx.input_splits, ctx.output_splits, ctx.group, ctx.tag), None, None, None, None


def all_to_all(
    x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: ProcessGroup | None,
    *, tag: str | None = None,
) -> torch.Tensor:
    """Forward: rows ``x[sum(input_splits[:r]) : ... + input_splits[r]]`` go to rank r; the result
    stacks the rows received from each rank in rank order (``output_splits[r]`` rows from rank r).
    Backward: the same exchange with the splits swapped, returning each row's gradient to its sender.
    Zero-row splits are fine. With a ``tag``, inside :func:`~megamoe.comms.comm_timeline` both exchanges
    record ``issue`` / ``wait_start`` / ``wait`` events (the whole call is blocked time), as
    :func:`~megamoe.comms.all_to_all_start` does for its waits.
    """
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, [int(s) for s in output_splits], [int(s) for s in input_splits], group, tag)


# ----------------------------------------------------------------------------------------------
# Expert migration (online rebalancing)
# ----------------------------------------------------------------------------------------------
def exchange_expert_slots(send_buffer: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                          group: ProcessGroup | None) -> torch.Tensor:
    """The one collective of an expert migration (:func:`megamoe.moe.placement.expert_migration.migrate_layer`),
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
