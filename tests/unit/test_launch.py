"""megamoe.cli.launch: a script's user error is one ``error:`` line; the rank that prints it is rank 0, and a
rank whose error rank 0 does not share (the job outlives the wait) still says what it was."""

import argparse

import pytest
import torch

from megamoe.cli import launch
from megamoe.cli.launch import run_script
from megamoe.errors import UsageError


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
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


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


def test_init_distributed_picks_the_backend_and_gpu_of_the_device(monkeypatch):
    # On CUDA (NCCL) the collective watchdog is armed with --comm-timeout and the process group's own timeout
    # (NCCL's watchdog, which aborts the process) comes DIAGNOSIS_RESERVE_S later; gloo times out itself. The
    # default group is bound to the GPU (device_id): NCCL starts eagerly, the model's groups split from it.
    calls, armed = [], []
    monkeypatch.setattr(launch.dist, "init_process_group",
                        lambda backend, timeout, **device: calls.append((backend, timeout.total_seconds(),
                                                                         *device.items())))
    monkeypatch.setattr(launch.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(launch.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(launch.collective_watchdog, "arm", armed.append)
    # What run_script registers: its one error line (process_group arms the watchdog with it).
    monkeypatch.setattr(launch.collective_watchdog, "_stuck_collective_handler", launch._end_on_stuck_collective)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch.init_distributed(comm_timeout_s=30, device="cpu") == (1, 2)
    assert not armed
    assert launch.init_distributed(comm_timeout_s=30, device=torch.device("cuda", 1)) == (1, 2)
    assert launch.init_distributed(comm_timeout_s=30, device="cuda") == (1, 2)   # no index: the local rank's GPU
    nccl = ("cpu:gloo,cuda:nccl", 30 + launch.collective_watchdog.DIAGNOSIS_RESERVE_S,
            ("device_id", torch.device("cuda", 1)))
    assert calls == [("gloo", 30.0), ("set_device", 1), nccl, ("set_device", 1), nccl]
    assert [(w.timeout_s, w.on_timeout) for w in armed] == [(30.0, launch._end_on_stuck_collective)] * 2


# ---- --comm-timeout, torchrun's other ranks, a rank left by a failed peer -------------------------------
@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5", "1e300"])
def test_a_comm_timeout_the_process_group_cannot_take_is_refused_at_parse_time(value, monkeypatch, capsys):
    # inf was accepted, then ended in an OverflowError under torchrun.
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    parser = launch.ScriptArgumentParser(prog="tool.py")
    launch.add_launch_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--comm-timeout", value])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"tool.py: error: argument --comm-timeout: must be a number of seconds > 0 and at most 3.1536e+07 (a "
        f"year), got {float(value)}")
    with pytest.raises(UsageError, match="--comm-timeout must be a number of seconds > 0"):
        launch.init_distributed(comm_timeout_s=float(value))
    assert parser.parse_args(["--comm-timeout", "30"]).comm_timeout == 30.0


def test_usage_help_and_parse_errors_come_from_local_rank_0_only(demo, monkeypatch, capsys):
    # Four ranks printed --help four times (1,376 lines) and a bad flag's usage once per rank.
    for argv, code in ((["--help"], 0), (["--steps", "many"], 2)):
        for local_rank, prints in (("1", False), ("0", True)):
            monkeypatch.setenv("LOCAL_RANK", local_rank)
            with pytest.raises(SystemExit) as exited:
                demo.parse_args(argv)
            out, err = capsys.readouterr()
            assert exited.value.code == code and bool(out + err) == prints, (argv, local_rank, out + err)


def test_a_rank_left_by_a_failed_peer_prints_no_traceback(monkeypatch, capsys):
    # Rank 0 failed alone (a full disk): rank 1's gloo error was a traceback; now one line, after the wait.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(launch.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(launch.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(launch.time, "sleep", lambda s: None)

    def left_alone(argv):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:29500")

    assert run_script(left_alone, [], prog="tool.py") == 1
    assert capsys.readouterr().err.splitlines() == [
        "tool.py: error: on rank 1: a peer rank's process ended during a collective; see that rank's error, if it "
        "printed one"]
    with pytest.raises(RuntimeError, match="a bug"):        # any other RuntimeError is still a bug
        run_script(lambda argv: (_ for _ in ()).throw(RuntimeError("a bug")), [], prog="tool.py")


def test_a_full_disk_under_the_metrics_log_names_the_file(monkeypatch, capsys):
    from megamoe.training.metric_sinks import build_metric_sinks
    monkeypatch.delenv("RANK", raising=False)

    def logs(argv):
        with build_metric_sinks(rank=0, jsonl_path="/dev/full") as sinks:
            sinks.start_run({"run_id": "x"})
        return 0

    assert run_script(logs, [], prog="tool.py") == 1
    assert capsys.readouterr().err.splitlines() == [
        "tool.py: error: cannot write the metrics log /dev/full: No space left on device"]
