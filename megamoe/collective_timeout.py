"""A collective that timed out, reported with the operation and the ranks that did not arrive.

gloo's own error ("Timed out waiting 600000ms for recv operation to complete") names neither the
collective nor the rank that is missing, nor does NCCL's ("Watchdog caught collective operation timeout:
WorkNCCL(SeqNum=7, OpType=ALLREDUCE, ..., Timeout(ms)=600000) ran for 600012 milliseconds before timing
out."). :mod:`megamoe.comms` turns either into a :class:`CollectiveTimeout` that does; on NCCL, whose
collectives return at once, the host-side :mod:`megamoe.collective_watchdog` finds the stuck one and
reports it the same way. Which ranks did not arrive is found out like this:

- Nothing is recorded while collectives succeed (no cost on the normal path).
- A rank whose collective times out writes ``waiting/<its global rank> = "<op> over ranks [..]"``
  into the process group's key-value store (torchrun's agent or the rendezvous file: it stays
  reachable while a worker is stopped), then waits a short grace period for the group's other
  ranks to do the same: every healthy rank of the group is waiting too, so times out within about
  the time it entered late.
- A rank of the group with no entry after the grace period did not arrive: it is stopped, hung, dead,
  or still busy outside any collective. A rank with an entry for another operation is itself
  stuck waiting there (the report names that operation).

After a timeout the group cannot be used again (gloo fails every later collective on it at once),
so the job has to end: :func:`megamoe.cli.launch.run_script` prints the message as one ``error:`` line
on the first rank that reports it.
"""

from __future__ import annotations

import re
import threading
import time

import torch.distributed as dist

__all__ = ["CollectiveTimeout", "is_timeout", "is_peer_failure"]

_STORE_PREFIX = "megamoe/collective_timeouts/"
# The grace period for the group's other ranks to report their own timeout: a quarter of the
# collective timeout, within these bounds (a healthy rank that entered the collective later than
# this one times out correspondingly later).
_GRACE_MIN_S, _GRACE_MAX_S, _GRACE_FRACTION = 2.0, 30.0, 0.25
# The store calls get this long beyond the grace period (a store hosted by the stuck rank itself
# never answers): the report then says that the missing rank is unknown.
_STORE_SLACK_S = 10.0
_POLL_S = 0.1


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than the process group's timeout for another rank.

    ``operation``: e.g. ``"all_reduce"``; ``group_ranks``: the group's global ranks; ``missing``: the
    ranks that did not arrive (None when that could not be found out); ``first_report``: whether this
    rank is the first of the job to report a timeout (the one that prints it; True on every rank
    when the store could not be asked).
    """

    def __init__(self, message: str, *, operation: str, group_ranks: tuple[int, ...],
                 missing: tuple[int, ...] | None, first_report: bool):
        super().__init__(message)
        self.operation, self.group_ranks = operation, group_ranks
        self.missing, self.first_report = missing, first_report

    @classmethod
    def diagnose(cls, operation: str, group_ranks: tuple[int, ...], error: BaseException | None = None, *,
                 timeout_s: float | None = None) -> "CollectiveTimeout":
        """The timeout report of ``operation`` over ``group_ranks`` (global ranks), after asking the
        store which of those ranks reported a timeout of their own (see the module docstring). The
        timeout is ``timeout_s``, else the one ``error`` (gloo's or NCCL's) names, if any."""
        rank = dist.get_rank()
        if timeout_s is None and error is not None:
            timeout_s = _timeout_seconds(str(error))
        what = f"{operation} over ranks {list(group_ranks)}"
        head = f"{what} timed out" + (f" after {timeout_s:g} s" if timeout_s else "") + f" on rank {rank}"
        grace = min(max(_GRACE_FRACTION * (timeout_s or 0.0), _GRACE_MIN_S), _GRACE_MAX_S)
        outcome: dict = {}
        worker = threading.Thread(target=_ask_store, args=(rank, what, group_ranks, grace, outcome), daemon=True)
        worker.start()
        worker.join(grace + _STORE_SLACK_S)
        if "waiting" not in outcome:
            detail = outcome.get("error", "the process group's store did not answer")
            return cls(f"{head}; could not tell which rank did not arrive ({detail})", operation=operation,
                       group_ranks=group_ranks, missing=None, first_report=True)
        waiting: dict[int, str] = outcome["waiting"]
        missing = tuple(r for r in group_ranks if r not in waiting)
        parts = []
        if missing:
            names = ", ".join(str(r) for r in missing)
            parts.append(f"rank{'s' if len(missing) > 1 else ''} {names} did not arrive "
                         "(stopped, hung, dead, or still busy outside any collective)")
        parts += [f"rank {r} is itself waiting in {op}" for r, op in sorted(waiting.items())
                  if r in group_ranks and op != what]
        if not parts:
            parts.append("every rank of the group was waiting in it (mismatched collectives?)")
        return cls(f"{head}: " + "; ".join(parts), operation=operation, group_ranks=group_ranks,
                   missing=missing, first_report=outcome["first_report"])


# gloo: "Timed out waiting 600000ms for recv operation to complete"; NCCL (ProcessGroupNCCL's
# WorkNCCL::checkTimeout, raised by wait() under TORCH_NCCL_BLOCKING_WAIT=1 or once the watchdog saw it):
# "Watchdog caught collective operation timeout: WorkNCCL(...) ran for N milliseconds before timing out."
_TIMEOUT_MARKERS = ("timed out", "collective operation timeout")


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` (raised by a torch.distributed call, gloo or NCCL) is a collective timeout."""
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _TIMEOUT_MARKERS)


# What gloo says on the ranks left in a collective when a peer's process ended (its sockets closed).
_PEER_FAILURE_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                         "connection refused")


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (raised by a torch.distributed call) says that another rank's process went away."""
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _PEER_FAILURE_MARKERS)


def _timeout_seconds(message: str) -> float | None:
    """gloo says "Timed out waiting 10000ms for recv", NCCL "WorkNCCL(..., Timeout(ms)=10000)": the
    timeout in seconds, if the message has it."""
    found = re.search(r"waiting (\d+)\s*ms", message) or re.search(r"Timeout\(ms\)=(\d+)", message)
    return int(found.group(1)) / 1000 if found else None


def _ask_store(rank: int, what: str, group_ranks: tuple[int, ...], grace_s: float, outcome: dict) -> None:
    """Record this rank's timeout, wait up to ``grace_s`` for the group's other ranks' records, and
    put ``waiting`` ({rank: operation}) and ``first_report`` into ``outcome`` (``error`` on failure)."""
    try:
        store = dist.PrefixStore(_STORE_PREFIX, dist.distributed_c10d._get_default_store())
        store.set(f"waiting/{rank}", what)
        first_report = store.add("reports", 1) == 1
        # Polled with check (store.wait would log a warning per timed-out wait).
        others = {r: f"waiting/{r}" for r in group_ranks if r != rank}
        end = time.monotonic() + grace_s
        while not store.check(list(others.values())) and time.monotonic() < end:
            time.sleep(_POLL_S)
        waiting = {rank: what}
        for r, key in others.items():
            if store.check([key]):
                waiting[r] = store.get(key).decode()
        outcome.update(waiting=waiting, first_report=first_report)
    except Exception as e:  # noqa: BLE001 - the report says that the store failed, and how
        outcome["error"] = f"{type(e).__name__}: {e}"
