"""Lines printed once torchrun has exited: a failed job ends with torchrun's ~40-line ChildFailedError
report, printed after its workers have exited, so no worker can print after it; a detached helper
process (this file, run as a script with the standard library only) can.

Two kinds of helper, both under torchrun only (``TORCHELASTIC_RUN_ID`` set):

- :func:`repeat_after_torchrun`: a rank's error line, printed again after the report. A *cause* (the
  error itself) comes a moment after the notes (a rank's line that a peer left, printed only where the
  rank has no watching helper), so it is the last line.
- :func:`watch_this_rank`: started for every rank when the script starts; if the rank's process ends
  without run_script having finished (killed by a signal: the OOM killer, or torchrun's SIGTERM after
  another rank was killed), it prints one line after the report saying that torchrun stopped the job and
  where the newest intact checkpoint is (:func:`note_newest_checkpoint`). Only one rank's helper prints
  it, and none where a rank printed an error of its own (the cause comes last, alone).

The helpers agree through Linux abstract unix sockets named after torchrun's pid, which a process
holds until it exits (nothing to clean up): ``cause`` is held from before a rank with an error exits
until its line is printed; ``stopped`` by the one helper that will print the stop line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

__all__ = ["repeat_after_torchrun", "watch_this_rank", "note_newest_checkpoint", "rank_finished",
           "wait_for_lines_after"]

# After torchrun's exit: notes at once, a cause a moment later (last).
_CAUSE_DELAY_S = 0.5
# A helper gives up waiting for torchrun after this (nothing lingers if torchrun lives on).
_WAIT_LIMIT_S = 300.0
# A helper that printed a cause or the stop line holds its claim this long more (its stderr closed), so
# that another helper slowed down by a loaded machine still finds the claim held.
_CLAIM_HOLD_S = 3.0

_watch_pipe = None      # this rank's end of the pipe to its watching helper, see watch_this_rank


def _claim(kind: str, torchrun_pid: int) -> socket.socket | None:
    """The socket holding the name ``kind`` for this torchrun job, or None if another process holds it
    (or the platform has no abstract sockets)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0megamoe-{kind}-{torchrun_pid}")
    except OSError:
        sock.close()
        return None
    return sock


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _spawn(args: list[str], pass_fds=()) -> None:
    subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), *args], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, start_new_session=True, pass_fds=pass_fds)


def repeat_after_torchrun(line: str, *, cause: bool = True) -> None:
    """Under torchrun, have ``line`` printed again once torchrun has exited (see the module docstring). A
    note (not a ``cause``) is dropped where this rank has a watching helper: if no rank has an error of its
    own, that helper's stop line says more, and a note printed by another process could come after it."""
    if not _under_torchrun() or (not cause and _watch_pipe is not None):
        return
    claim = _claim("cause", os.getppid()) if cause else None
    try:
        _spawn(["repeat", str(os.getppid()), line, str(_CAUSE_DELAY_S if cause else 0.0)],
               pass_fds=(claim.fileno(),) if claim else ())
    except OSError:
        pass                # the line was printed once already
    finally:
        if claim is not None:
            claim.close()   # the helper holds it now


def watch_this_rank(prog: str) -> None:
    """Under torchrun, start the helper that prints the stop line if this process ends before
    :func:`rank_finished` (see the module docstring)."""
    global _watch_pipe
    if not _under_torchrun() or _watch_pipe is not None:
        return
    read_end, write_end = os.pipe()
    try:
        _spawn(["watch", str(os.getppid()), prog, str(read_end)], pass_fds=(read_end,))
    except OSError:
        os.close(write_end)
        return
    finally:
        os.close(read_end)
    _watch_pipe = os.fdopen(write_end, "w", buffering=1)


def note_newest_checkpoint(path: str | os.PathLike) -> None:
    """Tell this rank's helper the newest intact checkpoint (a completed save, or the verified one the run
    resumed), which the stop line names."""
    if _watch_pipe is not None:
        try:
            _watch_pipe.write(f"checkpoint {' '.join(os.fspath(path).splitlines())}\n")
        except OSError:
            pass            # the helper is gone: no stop line, nothing else lost


def rank_finished() -> None:
    """This rank ends as run_script decided (its result, or its error reported): its helper prints nothing."""
    global _watch_pipe
    if _watch_pipe is not None:
        try:
            _watch_pipe.write("finished\n")
            _watch_pipe.close()
        except OSError:
            pass
        _watch_pipe = None


def wait_for_lines_after(torchrun_pid: int, limit_s: float = _WAIT_LIMIT_S) -> None:
    """For the process that started torchrun (``megamoe train --nproc-per-node``), once torchrun has exited:
    wait until no helper of that job holds a claim (its line printed), so that the line comes before this
    process exits and the shell prompt returns."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        claims = [_claim(kind, torchrun_pid) for kind in ("cause", "stopped")]
        for claim in claims:
            if claim is not None:
                claim.close()
        if all(claim is not None for claim in claims):
            return
        time.sleep(0.05)


def _stop_line(prog: str, checkpoint: str | None) -> str:
    line = (f"{prog}: error: torchrun stopped the job: a rank's process ended without reporting an error (killed "
            "by a signal, e.g. by the out-of-memory killer, or crashed), or the job itself was signalled; "
            "torchrun's report above names the rank and its exit code")
    return line + (f"; the newest intact checkpoint is {checkpoint}" if checkpoint else "")


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie, not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] == "Z"
    except OSError:
        return False


def _wait_until_gone(pid: int) -> bool:
    end = time.monotonic() + _WAIT_LIMIT_S
    while not _gone(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return _gone(pid)


def _repeat(torchrun_pid: int, line: str, delay_s: float) -> None:
    if _wait_until_gone(torchrun_pid):
        time.sleep(delay_s)
        sys.stderr.write(line + "\n")
    if delay_s:             # a cause: it may hold the claim (inherited)
        _hold_claims()


def _hold_claims() -> None:
    sys.stderr.flush()
    os.close(2)
    time.sleep(_CLAIM_HOLD_S)


def _watch(torchrun_pid: int, prog: str, pipe_fd: int) -> None:
    checkpoint, finished = None, False
    with os.fdopen(pipe_fd) as pipe:
        for message in pipe:        # until the rank's process ends
            if message.startswith("checkpoint "):
                checkpoint = message[len("checkpoint "):].rstrip("\n")
            finished = finished or message == "finished\n"
    if finished:
        return
    # Held until this process exits: the other ranks' helpers, whose processes end too, stay quiet.
    stopped = _claim("stopped", torchrun_pid)
    if stopped is None or not _wait_until_gone(torchrun_pid):
        return
    cause = _claim("cause", torchrun_pid)
    if cause is None:
        return              # a rank's own error comes last
    sys.stderr.write(_stop_line(prog, checkpoint) + "\n")
    _hold_claims()


if __name__ == "__main__":
    if sys.argv[1] == "repeat":
        _repeat(int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
    else:
        _watch(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
