"""scripts/gpu_check.sh and the python it runs (issue 29's first-GPU check), as far as a CPU can check them:
the shell syntax, the dry run's table (every GPU row skipped, every training command's arguments accepted by
the training script's own checks), a refused command as a failed row, the one-line error without a GPU, and
the grouped-GEMM row's logic run on CPU (where torch._grouped_mm runs too), and the block-FP8 row's against a
CPU stand-in for blockwise torch._scaled_mm."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

from megamoe.cli.launch import run_script

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"



def _table(out: str) -> dict[str, tuple[str, str]]:
    """check -> (status, detail) of the printed table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("check "))
    rows = [re.split(r"\s{2,}", line.strip(), maxsplit=3) for line in lines[start + 1:]]
    return {row[0]: (row[1], row[3] if len(row) > 3 else "") for row in rows}


def test_the_shell_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")], capture_output=True).returncode == 0


def test_the_dry_run_prints_the_table_with_every_gpu_row_skipped(capsys, gpu_check):
    check = gpu_check
    assert check.main(["--dry-run"]) == 0
    table = _table(capsys.readouterr().out)
    expected = {"smoke", "row 2 pp2 bf16 autocast (cuda)", "row 3 eval on device", "row 1 pp2 V2 2048x4096",
                "row 7/9 grouped_mm bf16", "row 7 block-FP8 scaled_mm"} | {
        f"row 9/10/13 compiled seed {seed}" for seed in check.COMPILED_SEEDS}
    assert set(table) == expected, table
    assert {status for status, _ in table.values()} == {"skipped: no GPU"}, table
    assert "--comm-timeout 60" in table["row 1 pp2 V2 2048x4096"][1]
    assert "--hidden 4096 --seq-len 2048 --micro-batch 1" in table["row 1 pp2 V2 2048x4096"][1]
    for name in ("row 2 pp2 bf16 autocast (cuda)", "row 3 eval on device", "row 1 pp2 V2 2048x4096"):
        assert table[name][1].startswith("arguments accepted"), table[name]


def test_a_refused_command_is_a_failed_row_and_the_other_rows_still_show(monkeypatch, capsys, gpu_check):
    check = gpu_check
    monkeypatch.setattr(check, "TRAIN_FLAGS", [*check.TRAIN_FLAGS, "--hidden", "100"])    # not a multiple of 8
    assert check.main(["--dry-run"]) == 1
    table = _table(capsys.readouterr().out)
    assert table["row 3 eval on device"][0] == "FAIL" and "--hidden" in table["row 3 eval on device"][1]
    assert table["row 1 pp2 V2 2048x4096"][0] == "skipped: no GPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without a GPU")
def test_without_a_gpu_and_without_dry_run_is_one_error_line(monkeypatch, capsys, gpu_check):
    monkeypatch.delenv("RANK", raising=False)
    assert run_script(gpu_check.main, [], prog="gpu_check.py") == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gpu_check.py: error: no CUDA device is available") and "--dry-run" in line


def test_the_grouped_mm_row_compares_bf16_forward_and_backward_with_an_empty_slot_against_fp32(monkeypatch,
                                                                                             gpu_check):
    """The row's logic, on CPU: torch._grouped_mm has CPU kernels, so with its gate opened the bf16 experts
    run it here, empty slot included."""
    import megamoe.moe.experts.grouped_mlp as grouped_mlp

    check = gpu_check
    calls = []
    grouped_mm = torch._grouped_mm

    def recorded(*args, **kwargs):
        calls.append(args[0].dtype)
        return grouped_mm(*args, **kwargs)
    monkeypatch.setattr(torch, "_grouped_mm", recorded)
    monkeypatch.setattr(grouped_mlp, "grouped_mm_applies", lambda device, dtype: dtype == torch.bfloat16)
    row = check.check_grouped_mm(torch.device("cpu"))
    assert row.status == "ok", row
    assert "empty slot's gradients zero: True" in row.detail
    assert len(calls) == 6 and set(calls) == {torch.bfloat16}      # 2 forward, 4 backward grouped GEMMs


def _blockwise_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm's blockwise FP8 semantics, in fp32 on CPU: ``a`` [M, K] with 1x128 scales
    ``scale_a`` [M, K / 128], ``b`` [K, N] with 128x128 scales ``scale_b`` [K / 128, N / 128]."""
    a_hat = a.float() * scale_a.repeat_interleave(128, 1)[:, :a.shape[1]]
    b_hat = b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)[:b.shape[0], :b.shape[1]]
    return (a_hat @ b_hat).to(out_dtype)


def test_the_block_fp8_row_compares_scaled_mm_against_the_emulation(monkeypatch, gpu_check):
    """The row's logic and the kernel's operands, on CPU: with the probe opened and torch._scaled_mm replaced by
    its blockwise semantics, the ``torch`` backend's kept block-FP8 experts match the emulation (so the scales
    reach the kernel in the layout it reads, padded leading dimension included)."""
    import megamoe.moe.experts.fp8 as fp8
    import megamoe.moe.experts.kernel_probes as kernel_probes

    check = gpu_check
    monkeypatch.setattr(fp8, "block_scaled_mm_problem", lambda device: None)
    monkeypatch.setattr(kernel_probes, "block_scaled_mm_problem", lambda device: None)
    strides = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        strides.append(scale_b.stride())
        return _blockwise_scaled_mm(a, b, scale_a, scale_b, out_dtype)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    row = check.check_block_scaled_mm(torch.device("cpu"))
    assert row.status == "ok", row
    assert strides and all(stride[0] == 1 and stride[1] % 4 == 0 for stride in strides), strides
