"""The first-GPU check of issue 29: one prepared run that fits 10 minutes on one GPU and prints one table.

    scripts/gpu_check.sh [--dry-run]        # runs this file with python3 (or $PYTHON)

Rows (each bounded in time; one failing row never stops the others):

- ``smoke``: ``scripts/gpu_smoke.sh`` (training, FP8 backends, compiled generation, the ``cuda`` tests).
- ``row 2 pp2 bf16 autocast``: ``examples/pretrain_moe.py --pp 2 --autocast bf16`` for a few steps: the
  dtype between pipeline stages (two ranks: on two GPUs over NCCL; with one GPU on two CPU ranks, where the
  issue reproduces too).
- ``row 3 eval on device``: one GPU rank training with ``--eval-fraction``: evaluation batches on the model's device.
- ``row 7/9 grouped_mm bf16``: the ``torch`` experts (``torch._grouped_mm``) in bf16 on the GPU, forward and
  backward, with an empty slot, against the fp32 per-slot reference on CPU.
- ``row 7 block-FP8 scaled_mm``: kept block-FP8 experts with the ``block`` recipe on ``torch._scaled_mm``
  against the ``fp8_emulated`` reference.
- ``row 9/10/13 compiled seed N``: compiled against eager greedy generation for more seeds (the margin rule
  of ``scripts/gpu_smoke.py``; seed 0 is in the smoke).
- with two GPUs, ``row 1 pp2 V2 2048x4096``: the interleaved pipeline (pp 2, V 2) with [1, 2048, 4096] bf16
  activations over NCCL and ``--comm-timeout 60``: a deadlock ends as a failed row, not a hang.

``--dry-run`` (no GPU needed): runs the table logic, checks every training command's arguments with the
training script's own parser and checks, and reports every GPU row as ``skipped: no GPU``. Exits 1 when a
row failed, else 0; without a GPU and without ``--dry-run``: one ``error:`` line.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))        # run from a checkout without installing

from megamoe.cli.launch import HelpFormatter, run_script  # noqa: E402
from megamoe.errors import UsageError  # noqa: E402

PYTHON = os.environ.get("PYTHON", "python3")
NO_GPU = "skipped: no GPU"
# The training runs: tiny models, a few steps (what is checked is that they run, not what they learn).
TRAIN_FLAGS = ["--steps", "3", "--global-batch", "4", "--micro-batch", "1", "--corpus-bytes", "200000",
               "--hidden", "128", "--layers", "4", "--comm-timeout", "60"]
LARGE_ACTIVATIONS = ["--hidden", "4096", "--seq-len", "2048", "--micro-batch", "1", "--global-batch", "4",
                     "--layers", "4", "--experts", "4", "--steps", "2", "--comm-timeout", "60"]
COMPILED_SEEDS = (1, 2, 3)


@dataclass
class Row:
    check: str
    status: str          # "ok" | "FAIL" | "skipped: <why>"
    detail: str
    seconds: float = 0.0


@dataclass
class Command:
    """A training run: ``nproc`` ranks of examples/pretrain_moe.py (torchrun when more than one)."""

    nproc: int
    args: list[str]
    timeout_s: float

    def argv(self) -> list[str]:
        launcher = ([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(self.nproc)] if self.nproc > 1
                    else [PYTHON])
        return [*launcher, str(REPO / "examples/pretrain_moe.py"), *self.args]


def training_commands(gpus: int, work_dir: Path) -> dict[str, Command]:
    """The training rows' commands on a machine with ``gpus`` GPUs (the dry run checks them with 2)."""
    work = ["--work-dir", str(work_dir)]
    pp_device = "cuda" if gpus >= 2 else "cpu"
    commands = {
        f"row 2 pp2 bf16 autocast ({pp_device})": Command(
            2, ["--pp", "2", "--autocast", "bf16", "--device", pp_device, *TRAIN_FLAGS, *work], 180),
        "row 3 eval on device": Command(
            1, ["--device", "cuda", "--eval-fraction", "0.1", "--eval-every", "2", "--eval-iters", "1", *TRAIN_FLAGS,
                *work], 120),
    }
    if gpus >= 2:
        commands["row 1 pp2 V2 2048x4096"] = Command(
            2, ["--pp", "2", "--virtual-pipeline-stages", "2", "--autocast", "bf16", "--device", "cuda",
                "--corpus-bytes", "200000", *LARGE_ACTIVATIONS, *work], 180)
    return commands


def check_command_arguments(name: str, command: Command) -> Row:
    """The dry run's row for a training command: its arguments pass the script's parser and checks (the memory
    check against the GPU's memory is left to the real run: the meta device stands in for it)."""
    from megamoe.cli.train import parse_args
    from megamoe.training.pretrain_checks import check_arguments
    try:
        check_arguments(parse_args(command.args), command.nproc, torch.device("meta"))
    except (UsageError, ValueError, SystemExit) as error:
        return Row(name, "FAIL", f"arguments refused: {error}")
    return Row(name, NO_GPU, f"arguments accepted: {' '.join(command.args)}")


def run_command(name: str, command: Command) -> Row:
    started = time.monotonic()
    try:
        done = subprocess.run(command.argv(), cwd=REPO, capture_output=True, text=True, timeout=command.timeout_s)
    except subprocess.TimeoutExpired:
        return Row(name, "FAIL", f"no end within {command.timeout_s:.0f} s (a hang?)", time.monotonic() - started)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        last = (done.stderr.strip() or done.stdout.strip()).splitlines() or [""]
        return Row(name, "FAIL", f"exit code {done.returncode}: {last[-1][:200]}", seconds)
    return Row(name, "ok", f"{command.nproc} rank(s), {' '.join(command.args[:8])} ...", seconds)


def run_smoke() -> Row:
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", str(REPO / "scripts/gpu_smoke.sh")], cwd=REPO, timeout=300)
    except subprocess.TimeoutExpired:
        return Row("smoke", "FAIL", "no end within 300 s", time.monotonic() - started)
    return Row("smoke", "ok" if done.returncode == 0 else "FAIL",
               f"scripts/gpu_smoke.sh exit code {done.returncode} (its table above)", time.monotonic() - started)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want).norm() / want.norm().clamp(min=1e-30)).item()


def check_grouped_mm(device: torch.device) -> Row:
    """bf16 ``torch._grouped_mm`` experts, forward and backward with an empty slot, against fp32 per-slot GEMMs."""
    from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts
    from megamoe.moe.experts.grouped_mlp import grouped_mm_applies
    from megamoe.moe.experts.kernel_probes import grouped_mm_problem

    name = "row 7/9 grouped_mm bf16"
    if not grouped_mm_applies(device, torch.bfloat16):
        return Row(name, f"skipped: {grouped_mm_problem(device)}", "the per-slot loop runs instead")
    slots, hidden, ffn, counts = 4, 256, 512, torch.tensor([300, 0, 129, 83])
    g = torch.Generator().manual_seed(0)
    reference = GroupedExperts(ExpertsConfig(slots, hidden, ffn, backend="torch"))
    with torch.no_grad():
        reference.w_gate_up.copy_(torch.randn(reference.w_gate_up.shape, generator=g) * hidden ** -0.5)
        reference.w_down.copy_(torch.randn(reference.w_down.shape, generator=g) * ffn ** -0.5)
    gpu = GroupedExperts(ExpertsConfig(slots, hidden, ffn, backend="torch"), device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        gpu.w_gate_up.copy_(reference.w_gate_up)
        gpu.w_down.copy_(reference.w_down)
        reference.w_gate_up.copy_(gpu.w_gate_up.float().cpu())        # the same bf16-rounded weights
        reference.w_down.copy_(gpu.w_down.float().cpu())
    x = torch.randn(int(counts.sum()), hidden, generator=g).bfloat16()
    x_ref, x_gpu = x.float().requires_grad_(), x.to(device).requires_grad_()
    out_ref, out_gpu = reference(x_ref, counts), gpu(x_gpu, counts.to(device))
    grad = torch.randn(out_ref.shape, generator=g)
    out_ref.backward(grad)
    out_gpu.backward(grad.to(device, torch.bfloat16))
    errors = {"out": _relative_error(out_gpu, out_ref.detach()), "dx": _relative_error(x_gpu.grad, x_ref.grad),
              "dW1": _relative_error(gpu.w_gate_up.grad, reference.w_gate_up.grad),
              "dW2": _relative_error(gpu.w_down.grad, reference.w_down.grad)}
    empty_slot_zero = not gpu.w_gate_up.grad[1].any() and not gpu.w_down.grad[1].any()
    ok = max(errors.values()) < 2e-2 and empty_slot_zero
    return Row(name, "ok" if ok else "FAIL", ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
               + f" vs fp32 (tol 2e-2); empty slot's gradients zero: {empty_slot_zero}")


def check_block_scaled_mm(device: torch.device) -> Row:
    """Kept block-FP8 experts on ``torch._scaled_mm`` against the ``fp8_emulated`` reference (same weights)."""
    from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts
    from megamoe.moe.experts.fp8 import FP8Config
    from megamoe.moe.experts.kernel_probes import block_scaled_mm_problem
    from megamoe.quantization.block_fp8 import BlockFP8Config

    name = "row 7 block-FP8 scaled_mm"
    problem = block_scaled_mm_problem(device)
    if problem is not None:
        return Row(name, f"skipped: {problem}", "kept block-FP8 weights run emulated or dequantized")
    slots, hidden, ffn, counts = 2, 256, 384, torch.tensor([70, 0])
    fp8 = FP8Config(recipe="block")
    modules = {}
    for backend, where in (("fp8_emulated", torch.device("cpu")), ("torch", device)):
        module = GroupedExperts(ExpertsConfig(slots, hidden, ffn, backend=backend, fp8=fp8), device=where,
                                dtype=torch.bfloat16)
        module.keep_block_fp8(BlockFP8Config())
        modules[backend] = module
    with torch.no_grad():
        for param in ("w_gate_up", "w_gate_up_scale_inv", "w_down", "w_down_scale_inv"):
            getattr(modules["torch"], param).copy_(getattr(modules["fp8_emulated"], param).to(device))
    x = torch.randn(int(counts.sum()), hidden, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        want = modules["fp8_emulated"](x, counts).float()
        got = modules["torch"](x.to(device), counts.to(device))
    error = _relative_error(got, want)
    return Row(name, "ok" if error < 2e-2 else "FAIL", f"relative error {error:.1e} vs fp8_emulated (tol 2e-2)")


def smoke_module():
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "scripts/gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = module
    spec.loader.exec_module(module)
    return module


def timed(smoke, name: str, check, *args) -> Row:
    """``check(*args)``'s row named ``name``, with its time; an exception is the row's FAIL (``smoke``:
    scripts/gpu_smoke.py, whose run_check this is)."""
    started = time.monotonic()
    row = smoke.run_check(name, check, *args)
    return Row(name, row.status, row.detail, time.monotonic() - started)


def format_table(rows: list[Row]) -> str:
    lines = [("check", "status", "seconds", "detail")] + [(r.check, r.status, f"{r.seconds:.0f}", r.detail)
                                                          for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    return "\n".join(f"{c:<{widths[0]}}  {s:<{widths[1]}}  {t:>{widths[2]}}  {d}" for c, s, t, d in lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: run the table logic, check the training commands' arguments, skip the GPU rows")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not args.dry_run else 0
    if gpus == 0 and not args.dry_run:
        raise UsageError("no CUDA device is available: run it on a GPU machine, or with --dry-run to check the "
                         "script itself on CPU")
    smoke = smoke_module()
    with tempfile.TemporaryDirectory(prefix="megamoe-gpu-check-") as work_dir:
        commands = training_commands(gpus if gpus else 2, Path(work_dir))
        if gpus == 0:
            rows = [Row("smoke", NO_GPU, "scripts/gpu_smoke.sh")]
            rows += [check_command_arguments(name, command) for name, command in commands.items()]
            rows += [Row(name, NO_GPU, "") for name in ("row 7/9 grouped_mm bf16", "row 7 block-FP8 scaled_mm")]
            rows += [Row(f"row 9/10/13 compiled seed {seed}", NO_GPU, "") for seed in COMPILED_SEEDS]
        else:
            device = torch.device("cuda", 0)
            rows = [run_smoke()]
            rows += [run_command(name, command) for name, command in commands.items()]
            rows += [timed(smoke, "row 7/9 grouped_mm bf16", check_grouped_mm, device),
                     timed(smoke, "row 7 block-FP8 scaled_mm", check_block_scaled_mm, device)]
            rows += [timed(smoke, f"row 9/10/13 compiled seed {seed}", smoke.check_compiled_generation, device, 128,
                           seed) for seed in COMPILED_SEEDS]
    where = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else "no GPU (--dry-run)"
    print(f"megamoe GPU check on {where}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    print(format_table(rows))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(run_script(main, prog="gpu_check.py"))
