"""Joining a torchrun job from library code: the rank and world size torchrun announces, the device each
process drives (``--device auto|cpu|cuda``: one GPU per local rank) and its process group, whose
collectives time out (a stuck or dead rank ends the job instead of hanging it). Used by the command line
(:mod:`megamoe.cli.launch`) and by :func:`megamoe.training.pretrain.pretrain`.

On CUDA each process drives the GPU of its ``LOCAL_RANK`` (one GPU per local rank, as torchrun starts
them), its CUDA tensors travel over NCCL and its CPU tensors (metadata) over gloo; on CPU everything is gloo.
"""

from __future__ import annotations

import datetime
import os
from typing import Callable

import torch
import torch.distributed as dist

from megamoe import collective_watchdog
from megamoe.collective_timeout import CollectiveTimeout
from megamoe.errors import UsageError
from megamoe.matmul_peak import auto_autocast

__all__ = ["DEFAULT_COMM_TIMEOUT_S", "DEVICES", "check_comm_timeout", "launch_rank", "launch_world_size",
           "launch_local_rank", "resolve_device", "default_autocast", "distributed_backend", "init_distributed"]

# Minutes, not gloo's default 30 s (a slow checkpoint load on one rank is no hang) nor NCCL's 10 min + hang.
DEFAULT_COMM_TIMEOUT_S = 600.0
_MAX_COMM_TIMEOUT_S = 365 * 24 * 3600.0

DEVICES = ("auto", "cpu", "cuda")
# Per-device backends: NCCL for CUDA tensors, gloo for the CPU tensors a CUDA job still exchanges
# (metadata, objects); parallel_state then needs no gloo twin of its groups.
_CUDA_BACKEND = "cpu:gloo,cuda:nccl"



def check_comm_timeout(seconds: float) -> float:
    """``seconds`` if it is a collective timeout the process group can take; UsageError otherwise (inf
    overflows torch's timedelta conversion under torchrun, NaN and <= 0 never wait)."""
    if not 0 < seconds <= _MAX_COMM_TIMEOUT_S:
        raise UsageError(f"--comm-timeout must be a number of seconds > 0 and at most {_MAX_COMM_TIMEOUT_S:g} "
                         f"(a year), got {seconds}")
    return seconds



def launch_rank() -> int:
    """This process's global rank as torchrun announces it (0 for a plain ``python`` run); readable
    before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def launch_world_size() -> int:
    """The torchrun job's world size (1 for a plain ``python`` run), readable before the process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_local_rank() -> int:
    """This process's rank on its node as torchrun announces it (``LOCAL_RANK``; 0 for a plain run)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(requested: str) -> torch.device:
    """The device of ``--device requested``: ``cuda`` is this process's GPU, ``cuda:LOCAL_RANK``; ``auto``
    is that GPU when CUDA is available, else ``cpu``. UsageError for ``cuda`` without a usable GPU."""
    if requested not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
        raise UsageError(f"--device cuda: no CUDA device is available (torch {torch.__version__}, built with "
                         f"{built}); use --device cpu, or --device auto to take a GPU only where there is one")
    local_rank, count = launch_local_rank(), torch.cuda.device_count()
    if local_rank >= count:
        raise UsageError(f"--device {requested}: LOCAL_RANK {local_rank} needs GPU {local_rank}, but this node has "
                         f"{count}; start at most one process per GPU (torchrun --nproc-per-node)")
    return torch.device("cuda", local_rank)


def default_autocast(device: torch.device | str) -> str | None:
    """The ``TrainConfig.autocast`` a script uses unless told otherwise: ``"bf16"`` (fp32 master weights,
    bf16 matmuls) where the bf16 matmul peak measured on ``device`` pays for it, else None (fp32); logs why
    (:func:`megamoe.matmul_peak.auto_autocast`)."""
    return auto_autocast(device).autocast


def distributed_backend(device: torch.device | str) -> str:
    """The process-group backend for ``device``: NCCL for CUDA tensors (with gloo for CPU ones), gloo on CPU."""
    return _CUDA_BACKEND if torch.device(device).type == "cuda" else "gloo"


def _restart_store_options(timeout: datetime.timedelta) -> dict:
    """Under torchrun with a c10d rendezvous, the workers' store is the agent's, and it outlives a restart
    (``--max-restarts``): torch (2.13) reads it without a per-attempt prefix, so the restarted ranks found
    the killed ranks' gloo/NCCL addresses and failed to connect. Each attempt gets its own key prefix here
    (``TORCHELASTIC_RESTART_COUNT``); elsewhere ``env://`` as usual (empty: no options)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), launch_world_size(),
                          is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"/megamoe/attempt_{attempt}", store), "rank": launch_rank(),
            "world_size": launch_world_size()}


def init_distributed(*, comm_timeout_s: float = DEFAULT_COMM_TIMEOUT_S, device: torch.device | str = "cpu",
                     backend: str | None = None,
                     on_stuck_collective: Callable[[CollectiveTimeout], None] | None = None) -> tuple[int, int]:
    """Join the torchrun job's process group with collectives timing out after ``comm_timeout_s``
    seconds. ``device`` (see :func:`resolve_device`): on CUDA it becomes this process's current device,
    so that one process drives one GPU, and the backend (default: :func:`distributed_backend`) runs
    NCCL. Returns ``(rank, world_size)``; a plain ``python`` run (no ``WORLD_SIZE``) is rank 0 of 1 and
    creates no group.

    On CUDA a collective watchdog (:mod:`megamoe.collective_watchdog`) is armed with ``comm_timeout_s``:
    a stuck collective is handed, diagnosed, to ``on_stuck_collective`` (default: the handler the command
    line registered with :func:`~megamoe.collective_watchdog.on_stuck_collective`, which prints its one
    ``error:`` line and ends the process with exit code 1). The process group's own timeout (NCCL's
    watchdog, which would abort the process without it, and the gloo half's for CPU tensors; the groups of
    parallel_state inherit it) is then ``comm_timeout_s`` plus
    :data:`~megamoe.collective_watchdog.DIAGNOSIS_RESERVE_S`, so that the diagnosis comes first."""
    check_comm_timeout(comm_timeout_s)
    device = torch.device(device)
    device_options = {}
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else launch_local_rank())
        torch.cuda.set_device(device.index)
        # Bound to its GPU, the default group starts NCCL at once (not lazily at the first collective), and
        # the model's groups (parallel_state) are split from its communicator rather than bootstrapped anew.
        device_options["device_id"] = device
    world = launch_world_size()
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return 0, 1
    backend = backend or distributed_backend(device)
    watched = device.type == "cuda" and backend != "gloo"     # collectives that return before the data moved
    group_timeout_s = comm_timeout_s + (collective_watchdog.DIAGNOSIS_RESERVE_S if watched else 0.0)
    timeout = datetime.timedelta(seconds=group_timeout_s)
    dist.init_process_group(backend, timeout=timeout, **device_options, **_restart_store_options(timeout))
    if watched:
        collective_watchdog.arm(collective_watchdog.CollectiveWatchdog(
            comm_timeout_s, on_stuck_collective or collective_watchdog.stuck_collective_handler()))
    return dist.get_rank(), dist.get_world_size()
