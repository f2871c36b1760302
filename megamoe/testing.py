"""Run a function on N spawned CPU ranks joined in a gloo process group.

This is the one helper every multi-rank test (ours and a user's) goes through::

    def check(rank, world_size, scale):
        t = torch.ones(2) * rank
        dist.all_reduce(t)
        return t.tolist()

    results = run_on_ranks(check, world_size=2, args=(3,))   # one entry per rank

Guarantees:
- The rendezvous uses a fresh ``file://`` store in a temporary directory, so concurrent test runs
  never collide on a port.
- Each rank runs with ``torch.set_num_threads(1)`` (ranks share few cores; more threads thrash).
- If any rank raises, the others are terminated at once and the first failing rank's traceback is
  raised in the parent as :class:`RankFailure`.
- If the ranks do not all finish within ``timeout_s`` (a hung collective), every rank is killed and
  :class:`RankTimeout` names the ranks that had not finished.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailure", "RankTimeout", "run_on_ranks"]


class RankFailure(AssertionError):
    """A spawned rank raised; the message carries that rank's traceback."""


class RankTimeout(TimeoutError):
    """Spawned ranks did not finish in time (typically a hung or mismatched collective)."""


def _rank_entry(fn, rank, world_size, init_file, args, kwargs, result_queue, collective_timeout_s):
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            backend="gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            # A barrier-free destroy: a rank that finished must not wait for one that failed.
            dist.destroy_process_group()
        result_queue.put(("ok", rank, result))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the traceback
        result_queue.put(("error", rank, traceback.format_exc()))


# Errors a rank raises because ANOTHER rank died (its peer closed the connection): reported as a
# consequence, never as the cause.
_SECONDARY_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _failure(rank: int, payload: str, result_queue, world_size: int) -> RankFailure:
    """Build the failure report, preferring the root cause: when the first error is a secondary one,
    wait a moment for the failing rank's own traceback."""
    errors = {rank: payload}
    deadline = time.monotonic() + 3.0
    while any(m in payload for m in _SECONDARY_ERRORS) and time.monotonic() < deadline:
        try:
            status, other, other_payload = result_queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if status == "error":
            errors[other] = other_payload
            if not any(m in other_payload for m in _SECONDARY_ERRORS):
                rank, payload = other, other_payload
    others = sorted(set(errors) - {rank})
    also = f"\n(ranks {others} failed too, as a consequence)" if others else ""
    return RankFailure(f"rank {rank} of {world_size} failed:\n{payload}{also}")


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout_s: float = 180.0,
) -> list[Any]:
    """Spawn ``world_size`` gloo ranks, call ``fn(rank, world_size, *args, **kwargs)`` on each.

    ``fn`` must be picklable (a module-level function). Returns the per-rank return values ordered by
    rank. Raises :class:`RankFailure` with the failing rank's traceback, or :class:`RankTimeout`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    result_queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="megamoe-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        # Collectives time out a little before the harness does, so a hang surfaces as an error
        # from inside the rank when possible.
        collective_timeout_s = max(5.0, timeout_s * 0.9)
        procs = [
            ctx.Process(
                target=_rank_entry,
                args=(fn, rank, world_size, init_file, tuple(args), dict(kwargs or {}), result_queue,
                      collective_timeout_s),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise RankTimeout(
                        f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f}s "
                        "(a hung or mismatched collective?)"
                    )
                try:
                    status, rank, payload = result_queue.get(timeout=min(remaining, 0.5))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if r not in results and not p.is_alive() and p.exitcode not in (0, None)]
                    if dead:
                        # Give a dying rank's queued traceback a moment to arrive before reporting.
                        try:
                            status, rank, payload = result_queue.get(timeout=1.0)
                        except queue.Empty:
                            raise RankFailure(
                                f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                "without reporting (killed or crashed)"
                            ) from None
                    else:
                        continue
                if status == "error":
                    raise _failure(rank, payload, result_queue, world_size)
                results[rank] = payload
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
            result_queue.close()
    return [results[r] for r in range(world_size)]
