"""The torchrun entry points: the pretraining demo learns and resumes, and a failing rank ends a
job promptly with its own error."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


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
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert sum(r["loss"] for r in records[-5:]) / 5 < records[0]["loss"] - 1.0, "the loss must clearly fall"
    assert all(0 < r["balancedness"] <= 1 and r["tokens_per_s"] > 0 for r in records)
    assert "--- greedy sample ---" in first.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000020", "step_00000030"]

    # Resume under another layout (tp=2 x ep=2 all-gather) and keep going.
    resumed = _torchrun([*common[:1], "--tp", "2", "--ep", "2", "--dispatcher", "allgather", *common[7:],
                         "--steps", "32", "--load-dir", str(tmp_path / "ckpt")], 4, 600, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records[30:]] == [31, 32]


def test_demo_help_explains_the_flags():
    out = subprocess.run([sys.executable, str(REPO / "examples/pretrain_moe.py"), "--help"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0
    for flag in ("--tp", "--pp", "--ep", "--etp", "--dispatcher", "--expert-backend", "--num-expert-slots",
                 "--steps", "--micro-batch", "--seed", "--save-dir", "--load-dir", "--log-json"):
        assert flag in out.stdout


@pytest.mark.slow
def test_failing_rank_ends_the_job_promptly(tmp_path):
    # Promptness without a clock: the script sets no collective timeout (gloo's default: 30 min), so
    # a job that waited for one would run into this 300 s limit (TimeoutExpired) instead of ending.
    result = _torchrun([str(REPO / "tests/torchrun_failing_rank.py")], 2, 300, tmp_path)
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr + result.stdout


@pytest.mark.slow
def test_stopped_rank_ends_the_job_with_one_error_naming_it(tmp_path):
    # Rank 1 SIGSTOPs itself mid-step: without a collective timeout the job would hang (the
    # subprocess limit below, far above --comm-timeout, only catches that). Its own session, so
    # that the finally can kill every process of the job, the stopped one included.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(REPO / "tests/torchrun_stuck_rank.py"), "--comm-timeout", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        _, stderr = job.communicate(timeout=300)
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()
    assert job.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("torchrun_stuck_rank.py: error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert re.search(r"error: all_to_all over ranks \[0, 1\] timed out after 10 s on rank 0: rank 1 did not "
                     r"arrive", errors[0]), errors[0]
    assert "CollectiveTimeout" not in stderr, "no worker traceback: " + stderr[-3000:]   # torchrun's own is fine
