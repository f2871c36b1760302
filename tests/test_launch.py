"""megamoe.launch: a script's user error is one ``error:`` line; the rank that prints it is rank 0, and a
rank whose error rank 0 does not share (the job outlives the wait) still says what it was."""

import pytest

from megamoe import launch
from megamoe.launch import UsageError, run_script


def _fails(argv):
    raise UsageError(f"--prompt-file {argv[0]}: no such file")


def test_rank_0_prints_one_line_and_returns_1(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert run_script(_fails, ["x.txt"], prog="tool.py") == 1
    assert capsys.readouterr().err.splitlines() == ["tool.py: error: --prompt-file x.txt: no such file"]


def test_another_rank_waits_then_names_itself(monkeypatch, capsys):
    waits = []
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(launch.time, "sleep", waits.append)
    assert run_script(_fails, ["x.txt"], prog="tool.py") == 1
    assert waits == [launch._QUIET_RANK_EXIT_DELAY_S]   # torchrun ends the job in this wait when rank 0 failed too
    assert capsys.readouterr().err.splitlines() == ["tool.py: error: on rank 3: --prompt-file x.txt: no such file"]


def test_a_run_stopped_for_non_finite_steps_is_one_error_line(monkeypatch, capsys):
    from megamoe.training.non_finite import NonFiniteTrainingError
    monkeypatch.delenv("RANK", raising=False)

    def diverges(argv):
        raise NonFiniteTrainingError("training stopped at step 7: 10 consecutive steps were non-finite")

    assert run_script(diverges, [], prog="tool.py") == 1
    assert capsys.readouterr().err.splitlines() == [
        "tool.py: error: training stopped at step 7: 10 consecutive steps were non-finite"]


def test_a_bug_is_not_a_user_error(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)

    def buggy(argv):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_script(buggy, [], prog="tool.py")


def test_the_traceback_on_request(monkeypatch):
    monkeypatch.setenv("MEGAMOE_TRACEBACK", "1")
    with pytest.raises(UsageError):
        run_script(_fails, ["x.txt"], prog="tool.py")
