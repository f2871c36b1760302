"""Run a function on N spawned ranks joined in a process group: gloo on CPU, or NCCL on one GPU per rank.

This is the one helper every multi-rank test (ours and a user's) goes through, and how
``megamoe-convert verify`` runs a checkpoint on its layout's ranks (a library module, not a test file)::

    def check(rank, world_size, scale):
        t = torch.ones(2) * rank
        dist.all_reduce(t)
        return t.tolist()

    results = run_on_ranks(check, world_size=2, args=(3,))   # one entry per rank

Guarantees:
- The rendezvous uses a fresh ``file://`` store in a temporary directory, so concurrent test runs
  never collide on a port.
- Each rank runs with ``torch.set_num_threads(1)`` (ranks share few cores; more threads thrash).
- Ranks are fresh processes forked from a server (multiprocessing's ``forkserver``) that imported torch
  and the library once, not started from scratch (``spawn``), which would pay those imports again in
  every rank, seconds of CPU each. As with ``spawn``, nothing of the caller's state is inherited but the
  function and arguments (pickled), ``sys.path``, the working directory and the environment (as it is
  at the call); the server itself never runs a torch operation, CUDA included, so forking it is safe.
- If any rank raises or dies, the others are terminated at once and :class:`RankFailure` names the
  root cause: a rank that died without reporting (killed, crashed) with its exit code or signal,
  else the first rank whose traceback is its own error (not "connection reset by peer", which a
  rank sees when ANOTHER rank died), with that traceback.
- If the ranks do not all finish within ``timeout_s`` (a hung collective), every rank is killed and
  :class:`RankTimeout` names the ranks that had not finished.

Backends (``backend=``, else the ``MEGAMOE_TEST_BACKEND`` environment variable, else ``gloo``; ``make
test-gpu`` sets it to ``nccl``): ``gloo`` runs the ranks on CPU. ``nccl`` needs a CUDA GPU per rank: rank
``r`` takes GPU ``r`` (``torch.cuda.set_device``, and as the default device, so that tensors a test creates
without a device are on it and its collectives run over NCCL); the group is ``cpu:gloo,cuda:nccl``, so
collectives on CPU tensors still work, and tensors in the results come back on CPU.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._pytree import tree_map

__all__ = ["BACKEND_ENV", "RankFailure", "RankTimeout", "run_on_ranks"]

BACKEND_ENV = "MEGAMOE_TEST_BACKEND"      # the backend when run_on_ranks is given none
_BACKENDS = ("gloo", "nccl")


class RankFailure(AssertionError):
    """A spawned rank raised; the message carries that rank's traceback."""


class RankTimeout(TimeoutError):
    """Spawned ranks did not finish in time (typically a hung or mismatched collective)."""


# What the fork server imports before it forks any rank: torch and the library's heavy packages (names
# only: this module imports none of them; one that fails to import is skipped, and a rank imports it
# itself). torch._dynamo too: a rank imports it at its first optimizer step (torch.optim's step and
# add_param_group) or grouped MoE forward (torch._disable_dynamo's first call), ~1.3 s of CPU in each.
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "megamoe.models", "megamoe.training")


def _rank_context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))     # read when the server starts: the first call
    return ctx


def _rank_entry(fn, rank, world_size, init_file, args, kwargs, result_queue, collective_timeout_s, backend,
                environ):
    try:
        # The caller's environment now, as a spawned process would have it (the server's is from its start).
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(1)
        group_backend, device_options = "gloo", {}
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            torch.set_default_device(device)
            group_backend, device_options = "cpu:gloo,cuda:nccl", {"device_id": device}
        dist.init_process_group(
            backend=group_backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
            **device_options,
        )
        # Every rank connected before any runs ``fn``: gloo's init can return on one rank while another is still
        # connecting its full mesh, and a rank whose ``fn`` returns at once would then close its connections under
        # it ("Connection closed by peer" in the other rank's init_process_group).
        dist.barrier()
        try:
            # On CPU before it leaves: a CUDA tensor sent through the queue dies with this process.
            result = _on_cpu(fn(rank, world_size, *args, **kwargs))
        finally:
            # A barrier-free destroy: a rank that finished must not wait for one that failed.
            dist.destroy_process_group()
        result_queue.put(("ok", rank, result))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the traceback
        result_queue.put(("error", rank, traceback.format_exc()))


def _on_cpu(result: Any) -> Any:
    return tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, result)


def _resolve_backend(backend: str | None, world_size: int) -> str:
    """``backend``, else $MEGAMOE_TEST_BACKEND, else gloo; ValueError naming the fix when it cannot run here."""
    source = "backend"
    if backend is None:
        backend, source = os.environ.get(BACKEND_ENV) or "gloo", f"${BACKEND_ENV}"
    if backend not in _BACKENDS:
        raise ValueError(f"run_on_ranks: {source} must be one of {_BACKENDS}, got {backend!r}")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world_size:
            raise ValueError(f"run_on_ranks: {source} 'nccl' needs one CUDA GPU per rank ({world_size} ranks), but "
                             f"this machine has {gpus}: run with backend 'gloo' (unset ${BACKEND_ENV}), or on a "
                             f"machine with {world_size} GPUs")
    return backend


# Errors a rank raises because ANOTHER rank died (its peer closed the connection): reported as a
# consequence, never as the cause.
_SECONDARY_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
# How long the parent waits, after a rank's error that names no cause of its own or after seeing a
# rank die, for the root cause (the dying rank's exit, or another rank's own traceback) to show.
_ROOT_CAUSE_GRACE_S = 10.0


def _is_secondary(payload: str) -> bool:
    return any(m in payload for m in _SECONDARY_ERRORS)


def _exit_description(exitcode: int) -> str:
    """``exit code 3`` or ``signal SIGKILL (exit code -9)``: how a rank's process ended."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"signal {name} (exit code {exitcode})"
    return f"exit code {exitcode}"


class _Outcomes:
    """What the parent knows about the ranks: results, reported errors, and silent deaths (a process
    that ended non-zero without reporting, i.e. killed or crashed), each death in the order seen."""

    def __init__(self, procs, result_queue):
        self.procs, self.queue = procs, result_queue
        self.results: dict[int, Any] = {}
        self.errors: dict[int, str] = {}          # rank -> traceback, in arrival order
        self.deaths: dict[int, int] = {}          # rank -> exit code, in the order first seen

    def poll(self, timeout: float) -> None:
        """Take the queued reports (waiting up to ``timeout`` for the first), then look for silent
        deaths: a rank whose process ended non-zero and whose report is not in the queue either."""
        self._drain(timeout)
        exited = [r for r, p in enumerate(self.procs)
                  if not self._reported(r) and r not in self.deaths and p.exitcode not in (0, None)]
        if exited:
            self._drain(0.5)     # a report put just before the process ended may still be in flight
            for rank in exited:
                if not self._reported(rank):
                    self.deaths[rank] = self.procs[rank].exitcode

    def _drain(self, timeout: float) -> None:
        while True:
            try:
                status, rank, payload = self.queue.get(timeout=timeout)
            except queue.Empty:
                return
            (self.results if status == "ok" else self.errors)[rank] = payload
            timeout = 0.0

    def _reported(self, rank: int) -> bool:
        return rank in self.results or rank in self.errors

    def failed(self) -> bool:
        return bool(self.errors or self.deaths)

    def root_cause_known(self) -> bool:
        """A death, or an error of the rank's own (not a peer's closed connection), has been seen."""
        return bool(self.deaths) or any(not _is_secondary(e) for e in self.errors.values())

    def failure(self, world_size: int) -> RankFailure:
        """The report, naming the root cause first: a rank that died silently (the others' errors
        are then its consequences: a killed peer resets their connections), else the first rank
        whose error is its own, else the first error."""
        if self.deaths:
            rank = next(iter(self.deaths))
            head = (f"rank {rank} of {world_size} died with {_exit_description(self.deaths[rank])} "
                    "without reporting an error (killed, or crashed in native code)")
        else:
            rank = next((r for r, e in self.errors.items() if not _is_secondary(e)), next(iter(self.errors)))
            head = f"rank {rank} of {world_size} failed:\n{self.errors[rank]}"
        others = sorted((set(self.errors) | set(self.deaths)) - {rank})
        also = f"\n(ranks {others} failed too, as a consequence)" if others else ""
        return RankFailure(head + also)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout_s: float = 180.0,
    collective_timeout_s: float | None = None,
    backend: str | None = None,
) -> list[Any]:
    """Spawn ``world_size`` ranks, call ``fn(rank, world_size, *args, **kwargs)`` on each.

    ``fn`` must be picklable (a module-level function). Returns the per-rank return values ordered by
    rank. Raises :class:`RankFailure` with the failing rank's traceback, or :class:`RankTimeout`.
    ``collective_timeout_s``: the process groups' timeout (default: a little under ``timeout_s``, so
    that a hung collective surfaces as a :class:`~megamoe.comms.CollectiveTimeout` inside the rank).
    ``backend``: ``gloo`` or ``nccl`` (see the module docstring; None: $MEGAMOE_TEST_BACKEND, else gloo).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if collective_timeout_s is not None and not collective_timeout_s > 0:
        raise ValueError(f"collective_timeout_s must be positive, got {collective_timeout_s}")
    backend = _resolve_backend(backend, world_size)
    ctx = _rank_context()
    result_queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="megamoe-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        # Collectives time out a little before the harness does, so a hang surfaces as an error
        # from inside the rank when possible.
        if collective_timeout_s is None:
            collective_timeout_s = max(5.0, timeout_s * 0.9)
        procs = [
            ctx.Process(
                target=_rank_entry,
                args=(fn, rank, world_size, init_file, tuple(args), dict(kwargs or {}), result_queue,
                      collective_timeout_s, backend, dict(os.environ)),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        # Tensors in the arguments go as named shared memory, not one file descriptor each: a fork server
        # takes at most 256 descriptors per process ("too many fds").
        strategy = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")
        try:
            for p in procs:
                p.start()
        finally:
            mp.set_sharing_strategy(strategy)
        outcomes = _Outcomes(procs, result_queue)
        deadline = time.monotonic() + timeout_s
        try:
            while len(outcomes.results) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outcomes.results))
                    raise RankTimeout(
                        f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f}s "
                        "(a hung or mismatched collective?)"
                    )
                outcomes.poll(timeout=min(remaining, 0.5))
                if outcomes.failed():
                    # A rank's error may only be the echo of another rank's death: wait (briefly)
                    # for the cause before naming a rank.
                    grace_end = time.monotonic() + _ROOT_CAUSE_GRACE_S
                    while not outcomes.root_cause_known() and time.monotonic() < grace_end:
                        outcomes.poll(timeout=0.2)
                    raise outcomes.failure(world_size)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
            result_queue.close()
    return [outcomes.results[r] for r in range(world_size)]
