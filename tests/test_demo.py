"""The torchrun entry points: the pretraining demo learns and resumes, and a failing rank ends a
job promptly with its own error."""

import json
import os
import subprocess
import sys
import time
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
    start = time.monotonic()
    result = _torchrun([str(REPO / "tests/torchrun_failing_rank.py")], 2, 300, tmp_path)
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr + result.stdout
    assert time.monotonic() - start < 120, "the surviving rank must not wait for a collective timeout"
