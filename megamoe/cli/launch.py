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

The device and process-group functions live in the library (:mod:`megamoe.process_group`, re-exported
here), the flags, the parser and the error handling here.

Devices: ``--device auto|cpu|cuda`` (:func:`add_device_argument`, :func:`resolve_device`). On CUDA each
process drives the GPU of its ``LOCAL_RANK`` (one GPU per local rank, as torchrun starts them), its CUDA
tensors travel over NCCL and its CPU tensors (metadata) over gloo; on CPU everything is gloo.

User errors are :class:`~megamoe.errors.UsageError` and the library's own errors for bad input (``ValueError``, which
covers :class:`~megamoe.checkpoint.errors.ConversionError` and config validation;
:class:`~megamoe.checkpoint.format.CheckpointError`; ``OSError`` such as a missing file), and a run stopped
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
arrive, and every one of them exits 1, which ends the torchrun job. On CUDA (NCCL, whose collectives
return before the data has moved) the host-side :mod:`~megamoe.collective_watchdog` finds the stuck
collective after ``--comm-timeout`` and ends the rank with the same line and exit code (see
:func:`init_distributed`).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
import time
from typing import Callable

import torch.distributed as dist

from megamoe import collective_watchdog
from megamoe.after_torchrun import rank_finished, repeat_after_torchrun, watch_this_rank
from megamoe.collective_timeout import CollectiveTimeout, is_peer_failure
from megamoe.errors import UsageError
from megamoe.process_group import (DEFAULT_COMM_TIMEOUT_S, DEVICES, check_comm_timeout, default_autocast,
                                   distributed_backend, init_distributed, launch_local_rank, launch_rank,
                                   launch_world_size, resolve_device)

__all__ = ["DEFAULT_COMM_TIMEOUT_S", "DEVICES", "HelpFormatter", "ScriptArgumentParser",
           "add_launch_arguments", "add_device_argument", "add_no_verify_checksums_argument", "check_comm_timeout",
           "launch_rank", "launch_world_size", "launch_local_rank", "resolve_device", "default_autocast",
           "distributed_backend", "init_distributed", "run_script"]

logger = logging.getLogger(__name__)

# torchrun terminates the other workers as soon as one exits: ranks other than the one that prints
# wait this long before printing and exiting on an error, so that the printing rank (which usually hits
# the same error or timeout) prints the only line and the job ends during the wait. A rank still alive
# afterwards had an error of its own (a file only it reads, say) and prints it.
_QUIET_RANK_EXIT_DELAY_S = 10.0


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
    checkpoint's files before they are read (see :mod:`megamoe.checkpoint.integrity`)."""
    parser.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                        help="do not hash the checkpoint's files before reading them (their sizes are still "
                             "checked); only for files you know are intact")


def run_script(main: Callable[..., int], argv=None, *, prog: str | None = None) -> int:
    """Run ``main(argv)``; a user error (see the module docstring) prints ``<prog>: error: <message>``
    on rank 0 (the other ranks stay quiet unless the job outlives a short wait) and returns 1; so does
    a collective timeout, printed by the first rank that reports it, and a collective a peer left. Other
    exceptions propagate."""
    global _script_prog
    prog = _script_prog = prog or os.path.basename(sys.argv[0])
    watch_this_rank(prog)
    collective_watchdog.on_stuck_collective(_end_on_stuck_collective)
    try:
        return main(argv)
    except CollectiveTimeout as e:
        if os.environ.get("MEGAMOE_TRACEBACK"):
            raise
        return _report(prog, _timeout_message(e), e.first_report)
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
        collective_watchdog.disarm()
        rank_finished()
        if dist.is_initialized():
            dist.destroy_process_group()


_script_prog: str | None = None     # the prog of the running run_script, for the collective watchdog's line


def _timeout_message(error: CollectiveTimeout) -> str:
    return f"{error}; if a rank is only slow, raise --comm-timeout"


def _end_on_stuck_collective(error: CollectiveTimeout) -> None:
    """The collective watchdog's ``on_timeout`` (on its thread): the line :func:`run_script` prints for a
    CollectiveTimeout, then the process ends with exit code 1 at once. The main thread is blocked in a
    CUDA wait that no exception reaches, and NCCL's watchdog would abort the process a little later."""
    prog = _script_prog or os.path.basename(sys.argv[0])
    code = 1
    try:
        if os.environ.get("MEGAMOE_TRACEBACK"):
            faulthandler.dump_traceback(all_threads=True)    # where the main thread is blocked
        code = _report(prog, _timeout_message(error), error.first_report)
        rank_finished()
        sys.stdout.flush()
    finally:
        os._exit(code)


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
    from megamoe.checkpoint.format import CheckpointError   # checkpoint_tools imports megamoe: import late
    return CheckpointError
