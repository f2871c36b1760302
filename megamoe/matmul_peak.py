"""The matmul peak per dtype of this device, measured once per process, and the compute dtype that
``auto`` picks from it (``--autocast auto``).

Measure, do not assume (issue 33): whether bf16 matmuls pay depends on the machine, not on the device
type. Measured with torch 2.13 on 2 threads: a Xeon with AMX runs a bf16 2048^3 matmul 5.6x faster than
fp32; the AMD EPYC of the test bench (avx512_bf16, no AMX) about 2x (217 against 102 GFLOP/s, 1024^3,
loaded; between 2x and 4.5x from run to run on that loaded 2-core VM, 1 or 2 threads); an AVX2-only CPU
ran bf16 below 20 GFLOP/s; fp16 on the EPYC ran 0.9 GFLOP/s.

The choice (:func:`choose_autocast`) takes bf16 where its measured peak is at least
:data:`BF16_MIN_SPEEDUP` times fp32's, else fp32. The margin is that large because a training step is
not all matmul: the casts of the inputs, the bf16 elementwise passes and the fp32 router, norms, loss and
optimizer step eat part of the matmul gain (issue 33: the project's bf16 autocast trained the demo model
at 0.74x fp32's tokens/s on the 5.6x Xeon; a bf16-autocast SwiGLU expert gained 1.33x there), and it
sits above the EPYC's noisy 2-4.5x so that a machine without AMX keeps fp32 (bf16 stays selectable:
``--autocast bf16``). The measurement is bounded: a slow dtype is timed on a 512^3 pilot matmul only (a
1024^3 fp16 matmul takes 2.4 s on the EPYC); the best of several repeats is taken, as other processes
only add time, and ``auto`` measures fp32 and bf16 in alternation (:func:`interleaved_peaks_tflops`), so that
a load passing during one dtype's measurement does not decide the ratio (measured one after the other, the
EPYC once read bf16 at 4.56x fp32 under load).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

__all__ = ["BF16_MIN_SPEEDUP", "PIN_ENV", "AutocastChoice", "choose_autocast", "auto_autocast", "matmul_peak_tflops",
           "interleaved_peaks_tflops", "measure_matmul_tflops"]

logger = logging.getLogger(__name__)

BF16_MIN_SPEEDUP = 4.0          # bf16's matmul peak over fp32's that `auto` asks for (see the module docstring)
_CLOSE_TO_MARGIN = 0.2          # within 20% of the margin: separate probes (torchrun ranks) may decide differently
_PILOT_SIZE = 512
# "bf16" or "none": pins what auto picks, without measuring. The test suite pins "none" (tests/conftest.py) so
# that every oracle test keeps its fp32 path on any machine, and so can runs whose ranks or restarts must agree.
PIN_ENV = "MEGAMOE_AUTOCAST_AUTO"
_PINNED = {"bf16": "bf16", "none": None}
_INTERLEAVED_ROUNDS = 2                                     # alternations of the dtypes auto compares
_PEAKS: dict[tuple[str, torch.dtype, int], float] = {}      # (device, dtype, threads) -> TFLOP/s, per process


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int, budget_s: float) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)                                                  # warm-up (kernel selection, packing)
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _synchronize(device)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent >= budget_s:
            break
    return 2 * size ** 3 / max(best, 1e-9) / 1e12


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, *, size: int = 1024, repeats: int = 8,
                          budget_s: float = 1.0) -> float:
    """The best of ``repeats`` timed ``size x size`` matmuls in ``dtype`` on ``device``, in TFLOP/s (after
    one warm-up): what a dense GEMM reaches on this device with this many threads. A pilot at 512^3 comes
    first: when it predicts that a warm-up and one timed matmul at ``size`` would exceed ``budget_s`` (a
    slow dtype: bf16 without AMX on old CPUs, fp16 on most CPUs), the pilot's figure is the answer. The
    timed loop also stops once its matmuls took ``budget_s``."""
    device = torch.device(device)
    pilot = _best_tflops(device, dtype, min(size, _PILOT_SIZE), repeats, budget_s)
    if size <= _PILOT_SIZE or 2 * (2 * size ** 3 / (pilot * 1e12)) > budget_s:
        return pilot
    return _best_tflops(device, dtype, size, repeats, budget_s)


def matmul_peak_tflops(device: torch.device | str, dtype: torch.dtype) -> float:
    """:func:`measure_matmul_tflops` of ``dtype`` on ``device``, measured once per process and thread
    count (the startup choice, the MFU peak and the benchmarks share it)."""
    device = torch.device(device)
    key = (str(device), dtype, torch.get_num_threads())
    if key not in _PEAKS:
        _PEAKS[key] = measure_matmul_tflops(device, dtype)
    return _PEAKS[key]


def interleaved_peaks_tflops(device: torch.device | str, dtypes: tuple[torch.dtype, ...],
                             rounds: int = _INTERLEAVED_ROUNDS) -> dict[torch.dtype, float]:
    """:func:`matmul_peak_tflops` of several ``dtypes`` compared with each other: measured in alternation,
    ``rounds`` times each, the best kept (then shared with :func:`matmul_peak_tflops`). On a shared machine
    the load changes from second to second; measured one after the other, a dtype timed while another process
    ran reads slow, and the ratio with it (what ``auto`` decides on) is off by that much. Alternating, a
    passing load depresses one round of each dtype, not all of one."""
    device = torch.device(device)
    threads = torch.get_num_threads()
    missing = [dtype for dtype in dtypes if (str(device), dtype, threads) not in _PEAKS]
    if missing:
        best = dict.fromkeys(dtypes, 0.0)
        for _ in range(rounds):
            for dtype in dtypes:
                best[dtype] = max(best[dtype], measure_matmul_tflops(device, dtype))
        _PEAKS.update({(str(device), dtype, threads): tflops for dtype, tflops in best.items()})
    return {dtype: _PEAKS[(str(device), dtype, threads)] for dtype in dtypes}


@dataclass(frozen=True)
class AutocastChoice:
    """What ``auto`` picks: ``autocast`` ("bf16", or None for fp32) and why, from the measured peaks."""

    autocast: str | None
    fp32_tflops: float
    bf16_tflops: float
    min_speedup: float
    reason: str

    @property
    def speedup(self) -> float:
        """bf16's measured matmul peak over fp32's."""
        return self.bf16_tflops / self.fp32_tflops

    @property
    def close_to_margin(self) -> bool:
        """Whether the speedup lies within 20% of the margin, where another measurement may decide otherwise."""
        return abs(self.speedup / self.min_speedup - 1.0) <= _CLOSE_TO_MARGIN


def choose_autocast(fp32_tflops: float, bf16_tflops: float, *, min_speedup: float = BF16_MIN_SPEEDUP
                    ) -> AutocastChoice:
    """bf16 when ``bf16_tflops >= min_speedup * fp32_tflops``, else None (fp32), with the reason."""
    if not fp32_tflops > 0 or not bf16_tflops > 0:
        raise ValueError(f"choose_autocast: peaks must be > 0, got fp32 {fp32_tflops}, bf16 {bf16_tflops}")
    if not min_speedup >= 1.0:
        raise ValueError(f"choose_autocast: min_speedup must be >= 1, got {min_speedup}")
    speedup = bf16_tflops / fp32_tflops
    figures = (f"measured matmul peak bf16 {bf16_tflops * 1e3:.4g} GFLOP/s, fp32 {fp32_tflops * 1e3:.4g} GFLOP/s: "
               f"{speedup:.2f}x")
    if speedup >= min_speedup:
        return AutocastChoice("bf16", fp32_tflops, bf16_tflops, min_speedup,
                              f"bf16 ({figures}, at least the {min_speedup:g}x a bf16 step needs to be faster)")
    return AutocastChoice(None, fp32_tflops, bf16_tflops, min_speedup,
                          f"fp32 ({figures}, under the {min_speedup:g}x a bf16 step needs to be faster; "
                          "--autocast bf16 forces it)")


def auto_autocast(device: torch.device | str) -> AutocastChoice:
    """The compute dtype ``--autocast auto`` runs on ``device``: :func:`choose_autocast` of the peaks
    measured here (once per process), or what :data:`PIN_ENV` pins. Logs the choice and why, and says when
    it is close to the margin: every torchrun rank measures on its own (`megamoe train` has them agree on one
    dtype: :func:`megamoe.training.pretrain.agreed_autocast`)."""
    pinned = os.environ.get(PIN_ENV)
    if pinned is not None:
        if pinned not in _PINNED:
            raise ValueError(f"{PIN_ENV} must be one of {sorted(_PINNED)} (or unset: measure), got {pinned!r}")
        nan = float("nan")
        logger.info("autocast auto on %s: %s, pinned by %s", torch.device(device), pinned, PIN_ENV)
        return AutocastChoice(_PINNED[pinned], nan, nan, BF16_MIN_SPEEDUP, f"{pinned}, pinned by {PIN_ENV}")
    peaks = interleaved_peaks_tflops(device, (torch.float32, torch.bfloat16))
    choice = choose_autocast(peaks[torch.float32], peaks[torch.bfloat16])
    close = (" (close to the margin: ranks or runs may decide differently; pass --autocast bf16 or none)"
             if choice.close_to_margin else "")
    logger.info("autocast auto on %s: %s%s", torch.device(device), choice.reason, close)
    return choice
