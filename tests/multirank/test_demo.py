"""The torchrun entry points: the pretraining demo learns and resumes, a rerun in the same directories
loses nothing and reuses the tokenizer and token file, user errors end in one line before any
expensive work, and a failing rank ends a job promptly with its own error.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_demo.py."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.demo import REPO, TINY, _assert_only_complete_checkpoint_of_step_1, _fault_line, _records


def _torchrun(args, nproc, timeout, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_pretrain_demo_learns_saves_and_resumes(tmp_path):
    common = [str(REPO / "examples/pretrain_moe.py"), "--pp", "2", "--ep", "2", "--dispatcher", "alltoall",
              "--work-dir", str(tmp_path), "--save-dir", str(tmp_path / "ckpt"), "--corpus-bytes", "400000",
              "--vocab-size", "512", "--hidden", "64", "--layers", "2", "--sample-tokens", "4", "--save-every", "10"]
    first = _torchrun([*common, "--steps", "30"], 4, 600, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    records = _step_records(tmp_path / "log.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    assert sum(r["loss"] for r in records[-5:]) / 5 < records[0]["loss"] - 1.0, "the loss must clearly fall"
    assert all(0 < r["balancedness"] <= 1 and r["tokens_per_s"] > 0 for r in records)
    assert "--- greedy sample ---" in first.stdout and "--- sample 3 (temperature" in first.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".lock", "step_00000020", "step_00000030"]

    # Resume under another layout (tp=2 x ep=2 all-gather) and keep going.
    resumed = _torchrun([*common[:1], "--tp", "2", "--ep", "2", "--dispatcher", "allgather", *common[7:],
                         "--steps", "32", "--load-dir", str(tmp_path / "ckpt")], 4, 600, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = _step_records(tmp_path / "log.jsonl")
    assert [r["step"] for r in records[30:]] == [31, 32]
    starts = [r for r in _records(tmp_path / "log.jsonl") if "run_start" in r]
    assert [r["resumed_from_step"] for r in starts] == [None, 30]
    assert "resuming from" in resumed.stderr and "step 30" in resumed.stderr


def _step_records(path):
    return [r for r in _records(path) if "step" in r]


def _assert_ends_with_our_line(stderr: str, line: str) -> None:
    """Our error line is printed by rank 0 only, and again once torchrun has printed its ChildFailedError
    report: the last line on the screen."""
    errors = [text for text in stderr.splitlines() if ": error:" in text]
    assert errors == [line, line], stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == line, stderr[-3000:]


@pytest.mark.slow
def test_torchrun_layout_error_is_one_line_from_rank_0(tmp_path):
    result = _torchrun([str(REPO / "examples/pretrain_moe.py"), "--tp", "3", "--work-dir", str(tmp_path / "w"),
                        *TINY], 2, 300, tmp_path)
    assert result.returncode != 0
    _assert_ends_with_our_line(
        result.stderr, "pretrain_moe.py: error: the layout --tp 3 --pp 1 --ep 1 (etp 3) does not fit 2 rank(s): "
                       "world_size 2 is not divisible by tp*cp*pp = 3*1*1 = 3; change the flags or the number of "
                       "ranks (torchrun --nproc-per-node)")
    assert "examples/pretrain_moe.py\", line" not in result.stderr, "no traceback of the script's code"
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_torchrun_bad_flag_and_help_are_printed_by_one_rank(tmp_path):
    # A bad flag (--comm-timeout inf: an OverflowError under torchrun before): argparse's usage and error once,
    # the error last.
    bad = _torchrun([str(REPO / "examples/pretrain_moe.py"), "--comm-timeout", "inf"], 2, 300, tmp_path)
    assert bad.returncode != 0 and bad.stderr.count("usage: pretrain_moe.py") == 1, bad.stderr[-3000:]
    _assert_ends_with_our_line(bad.stderr, "pretrain_moe.py: error: argument --comm-timeout: must be a number of "
                                           "seconds > 0 and at most 3.1536e+07 (a year), got inf")
    assert "OverflowError" not in bad.stderr
    helped = _torchrun([str(REPO / "examples/pretrain_moe.py"), "--help"], 2, 300, tmp_path)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert helped.stdout.count("usage: pretrain_moe.py") == 1 and helped.stdout.count("show this help message") == 1


@pytest.mark.slow
def test_failing_rank_ends_the_job_promptly(tmp_path):
    # Promptness without a clock: the collective timeout is the default 10 min, so a job that waited for one
    # would run into this 300 s limit (TimeoutExpired) instead of ending. Rank 0 fails alone (a full disk under
    # its metrics log): its error names the file and is the last line; rank 1, left in a collective, prints
    # no gloo traceback (at most a line saying that a peer left).
    result = _torchrun([str(REPO / "tests/helpers/torchrun_failing_rank.py")], 2, 300, tmp_path)
    assert result.returncode != 0
    line = "torchrun_failing_rank.py: error: cannot write the metrics log /dev/full: No space left on device"
    assert result.stderr.strip().splitlines()[-1] == line, result.stderr[-3000:]
    assert result.stderr.count("Traceback (most recent call last)") == 1, "torchrun's own only: " + result.stderr
    assert "torchrun_failing_rank.py\", line" not in result.stderr, "no traceback of a worker"


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "enospc"])
def test_torchrun_fault_ends_with_one_line_and_intact_checkpoints(fault, tmp_path):
    # kill: the last rank is SIGKILLed (as by the OOM killer): no rank reports an error, torchrun stops the
    # others (SIGTERM); a line saying so, naming the newest checkpoint, follows torchrun's report (before: the
    # report was the end, or a rank's note that a peer left). enospc: the last rank's checkpoint file meets a
    # full disk; rank 0's line names the file and the fix (before: safetensors' text, naming neither).
    script = str(REPO / "tests/helpers/torchrun_faults.py")
    result = _torchrun([script, fault, str(tmp_path / "ckpt")], 2, 300, tmp_path)
    assert result.returncode != 0
    assert _fault_line(fault, tmp_path / "ckpt").fullmatch(result.stderr.strip().splitlines()[-1]), \
        result.stderr[-3000:]
    assert result.stderr.count("Traceback (most recent call last)") == 1, "torchrun's own only: " + result.stderr
    assert result.stderr.count("error: torchrun stopped the job") == (fault == "kill"), "one rank says it, once"
    _assert_only_complete_checkpoint_of_step_1(tmp_path / "ckpt")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:    # a zombie (exited, not yet reaped by torchrun) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_stopped_rank_ends_the_job_with_one_error_naming_it(tmp_path):
    # Rank 1 SIGSTOPs itself mid-step: without a collective timeout the job would hang (the
    # subprocess limit below, far above --comm-timeout, only catches that). The ranks write their pids
    # into the job's directory, so that a hang can still be cleaned up: torchrun starts each worker in
    # a session of its own.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(REPO / "tests/helpers/torchrun_stuck_rank.py"), "--comm-timeout", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    lines: list[str] = []

    def end_the_stopped_rank_once_rank_0_reported():
        # torchrun gives a worker that ignores its SIGTERM 30 s before it kills it, and a stopped process
        # ignores everything but SIGKILL: once rank 0 has reported and exited, the stopped rank is killed
        # here (workers run in sessions of their own, so the job's process group does not reach them).
        for line in job.stderr:
            lines.append(line)
            if line.startswith("torchrun_stuck_rank.py: error:"):
                rank0 = int((tmp_path / "rank0.pid").read_text())
                for _ in range(600):
                    if not _alive(rank0):
                        break
                    time.sleep(0.1)
                _kill(int((tmp_path / "rank1.pid").read_text()))
    reader = threading.Thread(target=end_the_stopped_rank_once_rank_0_reported, daemon=True)
    reader.start()
    try:
        job.wait(timeout=300)
        reader.join(timeout=60)
        stderr = "".join(lines)
    finally:
        if job.poll() is None:      # a hang: end torchrun and its workers (their pids are still theirs)
            for pid_file in tmp_path.glob("rank*.pid"):
                _kill(int(pid_file.read_text()))
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert job.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("torchrun_stuck_rank.py: error:")]
    assert len(errors) == 2 and errors[0] == errors[1], stderr[-3000:]      # again after torchrun's report
    assert stderr.strip().splitlines()[-1] == errors[0], "the error is the last line: " + stderr[-3000:]
    assert re.search(r"error: all_to_all over ranks \[0, 1\] timed out after 10 s on rank 0: rank 1 did not "
                     r"arrive", errors[0]), errors[0]
    assert "CollectiveTimeout" not in stderr, "no worker traceback: " + stderr[-3000:]   # torchrun's own is fine
