"""scripts/gpu_smoke.sh and the python it runs: what a CPU can check of them (the shell syntax, the
table of a short CPU run, the one-line error for --device cuda without a GPU), and the smoke test
itself on a GPU (marked ``cuda``: skipped without one)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe.launch import run_script

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _smoke_module():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPTS / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = module          # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_shell_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_smoke.sh")], capture_output=True).returncode == 0


def test_a_short_cpu_run_trains_and_skips_what_needs_a_gpu(capsys):
    smoke = _smoke_module()
    assert smoke.main(["--device", "cpu", "--steps", "2", "--hidden-size", "32", "--no-compile"]) == 0
    table = capsys.readouterr().out.splitlines()
    status = dict(re.split(r"\s{2,}", line, maxsplit=2)[:2] for line in table[3:])   # check -> status
    assert status["train bf16"] == "ok", table
    assert set(status) == {"train bf16", "generate compiled"} | {f"fp8 {b}/{r}" for b, r, _ in smoke.FP8_CHECKS}
    if not torch.cuda.is_available():
        assert {status[f"fp8 {b}/{r}"] for b, r, _ in smoke.FP8_CHECKS} == {"skipped"}, table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without a GPU")
def test_cuda_without_a_gpu_is_one_error_line(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert run_script(_smoke_module().main, ["--device", "cuda"], prog="gpu_smoke.py") == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gpu_smoke.py: error: --device cuda: no CUDA device is available")


@pytest.mark.cuda
def test_gpu_smoke_passes_on_cuda(capsys):
    assert _smoke_module().main(["--device", "cuda"]) == 0, capsys.readouterr().out
