"""Every collective megamoe issues, in one place, with a call/byte counter.

Conventions
-----------
- ``group=None`` means *a group of one rank*: every function here is then the identity (no
  communication, nothing counted). This is NOT torch.distributed's "None = world" convention: layers
  built without groups are plain single-process modules.
- Functions named ``*_region`` / ``all_to_all`` are autograd functions; their docstrings say what
  happens forward and backward. The others (``all_reduce_``, ``batch_send_recv`` ...) move data without autograd.
- Every collective that moves data is recorded by the active :func:`comm_counter` (if any) with its
  kind, the group's global ranks and the bytes this rank contributes (its input buffer size).
- A collective that times out (the process group's timeout) raises
  :class:`~megamoe.collective_timeout.CollectiveTimeout`, naming the operation, the group's ranks
  and, where the store can tell, the ranks that did not arrive. On NCCL, whose calls return before the
  data has moved, every collective is handed to the armed :mod:`~megamoe.collective_watchdog`, which
  reports the stuck one the same way.

Tensor-parallel regions split / gather the LAST dim; sequence-parallel regions the FIRST dim, or the
``dim`` they are given (the model's hidden states are batch-first [B, S, H]: its sequence-parallel
regions pass ``dim=1``).

Uneven first dims. The sequence-parallel gather / reduce-scatter (and :func:`all_gather_into`) take
an optional ``sizes``: every rank's number of rows, in rank order (exchange them with
:func:`all_gather_sizes`). When they differ, each rank's rows are zero-padded to the largest count,
the equal-sized collective runs, and the padding is dropped, so ranks may hold any number of rows,
zero included (e.g. data-parallel attention, where each rank serves its own requests). Equal sizes
take the plain path: same calls, same bytes.

Where things live
-----------------
- :mod:`~megamoe.comms.groups`: ``group_size``, ``group_rank``, ``group_ranks``.
- :mod:`~megamoe.comms.counter`: :class:`CommCounter`, :func:`comm_counter`, the recording every collective
  does (``_record``) and the naming of timed-out collectives (``_timeout_named``).
- :mod:`~megamoe.comms.collectives`: raw collectives, no autograd: ``all_reduce_``, ``any_rank``,
  ``all_gather_into``, ``all_gather_sizes``, the distributed optimizer's ``reduce_scatter_flat`` / ``all_gather_flat``,
  ``all_gather_object``, ``broadcast_``, ``barrier``.
- :mod:`~megamoe.comms.tensor_parallel_regions`: the ``*_tensor_parallel_region`` autograd functions (last dim).
- :mod:`~megamoe.comms.sequence_parallel_regions`: the ``*_sequence_parallel_region`` autograd functions
  (first dim, or ``dim``), incl. ``gather_linears_from_sequence_parallel_region``.
- :mod:`~megamoe.comms.context_parallel_regions`: ``gather_from_context_parallel_region`` (attention's
  keys / values over the CP group: all-gather forward, reduce-scatter backward).
- :mod:`~megamoe.comms.expert_parallel`: ``all_to_all_counts``, the autograd ``all_to_all`` (uneven splits)
  and ``exchange_expert_slots`` (expert migration).
- :mod:`~megamoe.comms.point_to_point`: ``batch_send_recv`` (pipeline parallelism).
- :mod:`~megamoe.comms.async_collectives`: started-now, waited-later collectives (``async_op=True``) for
  overlapping communication with compute: ``all_reduce_async``, ``reduce_scatter_flat_async`` (return a
  :class:`CommHandle`), and the autograd pair ``all_to_all_start`` / ``all_to_all_wait``.
- :mod:`~megamoe.comms.timeline`: ``comm_timeline`` (issue / wait times of the asynchronous collectives and
  ``timed`` compute regions), the proof of overlap, timed by :mod:`~megamoe.comms.stream_clock` (CUDA events
  on the current stream on CUDA, the host clock elsewhere).

Import from the package (``from megamoe import comms; comms.all_reduce_(...)``): every name is re-exported
here, the counter list ``_active_counters`` included (the same list object the collectives record into).
"""

from __future__ import annotations

from megamoe.collective_timeout import CollectiveTimeout
from megamoe.comms.groups import group_rank, group_ranks, group_size
from megamoe.comms.counter import CommCounter, _active_counters, _record, _timeout_named, comm_counter
from megamoe.comms.collectives import (
    all_gather_flat,
    all_gather_into,
    all_gather_object,
    all_gather_sizes,
    all_reduce_,
    all_reduce_coalesced_,
    any_rank,
    barrier,
    broadcast_,
    reduce_scatter_flat,
)
from megamoe.comms.tensor_parallel_regions import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megamoe.comms.sequence_parallel_regions import (
    gather_from_sequence_parallel_region,
    gather_linears_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megamoe.comms.context_parallel_regions import gather_from_context_parallel_region
from megamoe.comms.expert_parallel import all_to_all, all_to_all_counts, exchange_expert_slots
from megamoe.comms.point_to_point import batch_send_recv
from megamoe.comms.async_collectives import (
    CommHandle,
    PendingAllToAll,
    all_reduce_async,
    all_to_all_start,
    all_to_all_wait,
    reduce_scatter_flat_async,
)
from megamoe.comms.timeline import Timeline, TimelineEvent, comm_timeline, record_event, timed

__all__ = [
    "CollectiveTimeout", "CommCounter", "comm_counter", "group_size", "group_rank", "group_ranks",
    "all_reduce_", "all_reduce_coalesced_", "any_rank", "all_gather_into", "all_gather_sizes", "all_gather_object",
    "all_to_all_counts", "broadcast_",
    "reduce_scatter_flat", "all_gather_flat",
    "batch_send_recv", "barrier",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_linears_from_sequence_parallel_region", "all_to_all",
    "exchange_expert_slots", "gather_from_context_parallel_region",
    "CommHandle", "PendingAllToAll", "all_reduce_async", "reduce_scatter_flat_async", "all_to_all_start",
    "all_to_all_wait", "Timeline", "TimelineEvent", "comm_timeline", "record_event", "timed",
]
