"""megamoe.launch: a script's user error is one ``error:`` line; the rank that prints it is rank 0, and a
rank whose error rank 0 does not share (the job outlives the wait) still says what it was."""

import argparse

import pytest
import torch

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


# ---- --device ----------------------------------------------------------------------------------
def _no_cuda(monkeypatch):
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: False)


def _gpus(monkeypatch, count):
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: count)


def test_auto_and_cpu_resolve_to_the_cpu_without_cuda(monkeypatch):
    _no_cuda(monkeypatch)
    assert launch.resolve_device("auto") == torch.device("cpu")
    assert launch.resolve_device("cpu") == torch.device("cpu")


def test_auto_and_cuda_take_the_gpu_of_the_local_rank(monkeypatch):
    _gpus(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert launch.resolve_device("auto") == launch.resolve_device("cuda") == torch.device("cuda", 2)
    assert launch.resolve_device("cpu") == torch.device("cpu")


def test_cuda_without_cuda_is_a_usage_error(monkeypatch):
    _no_cuda(monkeypatch)
    with pytest.raises(UsageError, match=r"--device cuda: no CUDA device is available .*use --device cpu"):
        launch.resolve_device("cuda")


def test_more_local_ranks_than_gpus_is_a_usage_error(monkeypatch):
    _gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(UsageError, match="LOCAL_RANK 2 needs GPU 2, but this node has 2"):
        launch.resolve_device("cuda")


def test_a_script_asked_for_cuda_without_one_prints_one_error_line(monkeypatch, capsys):
    _no_cuda(monkeypatch)
    monkeypatch.delenv("RANK", raising=False)

    def main(argv):
        parser = argparse.ArgumentParser()
        launch.add_device_argument(parser)
        launch.resolve_device(parser.parse_args(argv).device)
        return 0

    assert run_script(main, [], prog="tool.py") == 0                  # auto: the CPU
    assert run_script(main, ["--device", "cuda"], prog="tool.py") == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("tool.py: error: --device cuda: no CUDA device is available")


def test_bf16_autocast_by_default_on_cuda_only():
    assert launch.default_autocast(torch.device("cuda", 1)) == "bf16"
    assert launch.default_autocast("cpu") is None


def test_init_distributed_picks_the_backend_and_gpu_of_the_device(monkeypatch):
    calls = []
    monkeypatch.setattr(launch.dist, "init_process_group", lambda backend, timeout: calls.append(backend))
    monkeypatch.setattr(launch.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(launch.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(launch.torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch.init_distributed(device="cpu") == (1, 2)
    assert launch.init_distributed(device=torch.device("cuda", 1)) == (1, 2)
    assert launch.init_distributed(device="cuda") == (1, 2)            # no index: the local rank's GPU
    assert calls == ["gloo", ("set_device", 1), "cpu:gloo,cuda:nccl", ("set_device", 1), "cpu:gloo,cuda:nccl"]
