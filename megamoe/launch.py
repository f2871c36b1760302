"""What a torchrun entry point needs around its work: a process group whose collectives time out, and
user errors reported as one ``error:`` line with exit code 1 instead of a traceback per rank.

A script written with it::

    def main(argv=None) -> int:
        args = parse_args(argv)                 # parser built with add_launch_arguments(parser)
        validate(args)                          # raise UsageError("--prompt-file x: no such file") early
        device = resolve_device(args.device)    # add_device_argument(parser); UsageError without CUDA
        rank, world = init_distributed(comm_timeout_s=args.comm_timeout, device=device)
        ...                                     # model on `device`, TrainConfig(autocast=default_autocast(device))

    if __name__ == "__main__":
        sys.exit(run_script(main, prog="pretrain_moe.py"))

Devices: ``--device auto|cpu|cuda`` (:func:`add_device_argument`, :func:`resolve_device`). On CUDA each
process drives the GPU of its ``LOCAL_RANK`` (one GPU per local rank, as torchrun starts them), its CUDA
tensors travel over NCCL and its CPU tensors (metadata) over gloo; on CPU everything is gloo.

User errors are :class:`UsageError` and the library's own errors for bad input (``ValueError``, which
covers :class:`~checkpoint_tools.errors.ConversionError` and config validation;
:class:`~checkpoint_tools.format.CheckpointError`; ``OSError`` such as a missing file), and a run stopped
by :class:`~megamoe.training.non_finite.NonFiniteTrainingError` (a diverged run: the message says where
and what to do). Set
``MEGAMOE_TRACEBACK=1`` to get the traceback instead (for a bug report).

Under torchrun, :class:`ScriptArgumentParser` prints usage, ``--help`` and argparse's errors on local rank 0
only, and an error line is printed again once torchrun has printed its own ChildFailedError report, so that
it is the last line on the screen. A rank left in a collective by a peer whose process ended (gloo:
"Connection closed by peer") prints no traceback: a short line, after the failed rank's own. A job that
torchrun stops because a rank's process was killed (no rank reported an error) ends with a line saying so
and naming the newest intact checkpoint (see :mod:`megamoe.after_torchrun`).

A collective that times out (a stuck, dead or much slower rank) raises
:class:`~megamoe.collective_timeout.CollectiveTimeout` on the ranks waiting for it; the first of them
to report prints it as one ``error:`` line naming the operation, its ranks and the rank(s) that did not
arrive, and every one of them exits 1, which ends the torchrun job.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from megamoe.after_torchrun import rank_finished, repeat_after_torchrun, watch_this_rank
from megamoe.collective_timeout import CollectiveTimeout, is_peer_failure
from megamoe.matmul_peak import auto_autocast

__all__ = ["UsageError", "DEFAULT_COMM_TIMEOUT_S", "DEVICES", "HelpFormatter", "ScriptArgumentParser",
           "add_launch_arguments", "add_device_argument", "add_no_verify_checksums_argument", "check_comm_timeout",
           "launch_rank", "launch_world_size", "launch_local_rank", "resolve_device", "default_autocast",
           "distributed_backend", "init_distributed", "run_script"]

logger = logging.getLogger(__name__)

# Minutes, not gloo's default 30 s (a slow checkpoint load on one rank is no hang) nor NCCL's 10 min + hang.
DEFAULT_COMM_TIMEOUT_S = 600.0
_MAX_COMM_TIMEOUT_S = 365 * 24 * 3600.0
# torchrun terminates the other workers as soon as one exits: ranks other than the one that prints
# wait this long before printing and exiting on an error, so that the printing rank (which usually hits
# the same error or timeout) prints the only line and the job ends during the wait. A rank still alive
# afterwards had an error of its own (a file only it reads, say) and prints it.
_QUIET_RANK_EXIT_DELAY_S = 10.0


DEVICES = ("auto", "cpu", "cuda")
# Per-device backends: NCCL for CUDA tensors, gloo for the CPU tensors a CUDA job still exchanges
# (metadata, objects); parallel_state then needs no gloo twin of its groups.
_CUDA_BACKEND = "cpu:gloo,cuda:nccl"


class UsageError(ValueError):
    """Bad input a script's user fixes (a flag, a path, a layout): the message says what and how."""


class ScriptArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for a torchrun entry point: usage, ``--help`` and argparse's errors are
    printed by local rank 0 only (every rank parses the same flags and exits with the same code; four ranks
    printed ``--help`` four times), and under torchrun an error is repeated after torchrun's own report
    (see :func:`run_script`)."""

    def _print_message(self, message, file=None):
        if launch_local_rank() == 0:
            super()._print_message(message, file)

    def error(self, message):
        self.print_usage(sys.stderr)
        line = f"{self.prog}: error: {message}"
        if launch_local_rank() == 0:
            print(line, file=sys.stderr, flush=True)
            repeat_after_torchrun(line)
        self.exit(2)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of the scripts and ``megamoe-convert``: the description as written and every option's
    default, except where there is nothing to show: no default (None: the help says what it falls back
    to), an on/off flag (its name says what it changes), or a help text that names its default itself."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_launch_arguments(parser) -> None:
    """Add ``--comm-timeout SECONDS`` (collective timeout, see :func:`init_distributed`)."""
    parser.add_argument("--comm-timeout", type=_comm_timeout, default=DEFAULT_COMM_TIMEOUT_S, metavar="SECONDS",
                        help="a collective that waits longer than this for another rank fails, naming the "
                             "operation (a stuck or dead rank ends the job instead of hanging it)")


def check_comm_timeout(seconds: float) -> float:
    """``seconds`` if it is a collective timeout the process group can take; UsageError otherwise (inf
    overflows torch's timedelta conversion under torchrun, NaN and <= 0 never wait)."""
    if not 0 < seconds <= _MAX_COMM_TIMEOUT_S:
        raise UsageError(f"--comm-timeout must be a number of seconds > 0 and at most {_MAX_COMM_TIMEOUT_S:g} "
                         f"(a year), got {seconds}")
    return seconds


def _comm_timeout(text: str) -> float:
    try:
        return check_comm_timeout(float(text))
    except ValueError as e:         # UsageError included; argparse names the flag
        raise argparse.ArgumentTypeError(str(e).removeprefix("--comm-timeout ") if isinstance(e, UsageError) else
                                         f"must be a number of seconds, got {text!r}") from None


def add_device_argument(parser) -> None:
    """Add ``--device auto|cpu|cuda`` (``args.device``; see :func:`resolve_device`)."""
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the model runs: cuda (one GPU per local rank, NCCL), cpu (gloo), or auto: "
                             "cuda when a GPU is available, else cpu (default: auto)")


def add_no_verify_checksums_argument(parser) -> None:
    """Add ``--no-verify-checksums`` (``args.verify_checksums``, True by default): the opt-out of hashing a
    checkpoint's files before they are read (see :mod:`checkpoint_tools.integrity`)."""
    parser.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                        help="do not hash the checkpoint's files before reading them (their sizes are still "
                             "checked); only for files you know are intact")


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


def init_distributed(*, comm_timeout_s: float = DEFAULT_COMM_TIMEOUT_S, device: torch.device | str = "cpu",
                     backend: str | None = None) -> tuple[int, int]:
    """Join the torchrun job's process group with collectives timing out after ``comm_timeout_s``
    seconds. ``device`` (see :func:`resolve_device`): on CUDA it becomes this process's current device,
    so that one process drives one GPU, and the backend (default: :func:`distributed_backend`) runs
    NCCL. Returns ``(rank, world_size)``; a plain ``python`` run (no ``WORLD_SIZE``) is rank 0 of 1 and
    creates no group."""
    check_comm_timeout(comm_timeout_s)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else launch_local_rank())
    world = launch_world_size()
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return 0, 1
    dist.init_process_group(backend or distributed_backend(device), timeout=datetime.timedelta(seconds=comm_timeout_s))
    return dist.get_rank(), dist.get_world_size()


def run_script(main: Callable[..., int], argv=None, *, prog: str | None = None) -> int:
    """Run ``main(argv)``; a user error (see the module docstring) prints ``<prog>: error: <message>``
    on rank 0 (the other ranks stay quiet unless the job outlives a short wait) and returns 1; so does
    a collective timeout, printed by the first rank that reports it, and a collective a peer left. Other
    exceptions propagate."""
    prog = prog or os.path.basename(sys.argv[0])
    watch_this_rank(prog)
    try:
        return main(argv)
    except CollectiveTimeout as e:
        if os.environ.get("MEGAMOE_TRACEBACK"):
            raise
        return _report(prog, f"{e}; if a rank is only slow, raise --comm-timeout", e.first_report)
    except (ValueError, OSError, _checkpoint_error(), _non_finite_training_error()) as e:
        if os.environ.get("MEGAMOE_TRACEBACK"):
            raise
        return _report(prog, str(e), _rank() == 0)
    except RuntimeError as e:
        if os.environ.get("MEGAMOE_TRACEBACK") or not (dist.is_initialized() and is_peer_failure(e)):
            raise
        # Another rank ended (its own error line, if it could print one, says why): no gloo traceback here.
        # The line comes after torchrun's report (before the failed rank's own; where the rank has no
        # watching helper, see megamoe.after_torchrun), or if the job outlives the wait.
        message = "a peer rank's process ended during a collective; see that rank's error, if it printed one"
        repeat_after_torchrun(f"{prog}: error: on rank {_rank()}: {message}", cause=False)
        return _report(prog, message, False)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        rank_finished()
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else launch_rank()


def _report(prog: str, message: str, prints: bool) -> int:
    """Print ``message`` as one ``error:`` line where ``prints``; elsewhere first wait (torchrun ends the
    job when the first worker exits, and the printing rank must get to print first), then print it
    naming this rank if the job is still running. Returns 1."""
    one_line = " ".join(message.split("\n"))
    if prints:
        print(f"{prog}: error: {one_line}", file=sys.stderr, flush=True)
        repeat_after_torchrun(f"{prog}: error: {one_line}")
    else:
        time.sleep(_QUIET_RANK_EXIT_DELAY_S)
        print(f"{prog}: error: on rank {_rank()}: {one_line}", file=sys.stderr, flush=True)
    return 1


def _non_finite_training_error() -> type[Exception]:
    from megamoe.training.non_finite import NonFiniteTrainingError   # imports the training stack: import late
    return NonFiniteTrainingError


def _checkpoint_error() -> type[Exception]:
    from checkpoint_tools.format import CheckpointError   # checkpoint_tools imports megamoe: import late
    return CheckpointError
