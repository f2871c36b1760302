"""The helpers that print after torchrun has exited (megamoe/after_torchrun.py), run here without torchrun: a
``sleep`` process stands for torchrun, pipes for the ranks. Under torchrun: tests/multirank/test_demo.py's fault
cases."""

import os
import subprocess
import sys

import megamoe.after_torchrun as after_torchrun


def _watchers(torchrun_pid: int, messages: list[str], count: int) -> list[subprocess.Popen]:
    """``count`` rank helpers watching for ``torchrun_pid``, each told ``messages``, whose ranks then end."""
    helpers = []
    for _ in range(count):
        read_end, write_end = os.pipe()
        helpers.append(subprocess.Popen([sys.executable, "-I", "-S", after_torchrun.__file__, "watch",
                                         str(torchrun_pid), "prog.py", str(read_end)],
                                        pass_fds=(read_end,), stderr=subprocess.PIPE, text=True))
        os.close(read_end)
        with os.fdopen(write_end, "w") as pipe:      # closed: the rank's process ended
            pipe.writelines(messages)
    return helpers


def _lines_after_torchrun_exits(messages: list[str], count: int = 2, cause: bool = False) -> list[str]:
    torchrun = subprocess.Popen(["sleep", "60"])
    claim = after_torchrun._claim("cause", torchrun.pid) if cause else None   # a rank's error line is pending
    helpers = []
    try:
        helpers += _watchers(torchrun.pid, messages, count)
        torchrun.kill()
        torchrun.wait()
        # Until each closes its stderr (a helper that printed then holds its claim a while longer).
        return [line for helper in helpers for line in helper.stderr.read().splitlines()]
    finally:
        for helper in helpers:
            helper.kill()
            helper.wait()
        if claim is not None:
            claim.close()


def test_a_killed_rank_leaves_one_line_naming_the_newest_checkpoint():
    lines = _lines_after_torchrun_exits(["checkpoint /x/step_1\n", "checkpoint /x/step_2\n"])
    assert lines == [after_torchrun._stop_line("prog.py", "/x/step_2")]      # one of the two ranks says it
    assert lines[0].startswith("prog.py: error: torchrun stopped the job: a rank's process ended without")
    assert lines[0].endswith("; the newest intact checkpoint is /x/step_2")


def test_no_stop_line_after_a_finished_rank_or_a_ranks_own_error():
    assert _lines_after_torchrun_exits(["checkpoint /x/step_1\n", "finished\n"], count=1) == []
    assert _lines_after_torchrun_exits(["checkpoint /x/step_1\n"], cause=True) == []
