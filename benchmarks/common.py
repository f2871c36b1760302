"""What several benchmark scripts share: their argument parser, the allocator setting, transformers'
experts implementations that cannot run on CPU, timing one call and writing the results.

The scripts import it as a sibling module (``python benchmarks/<script>.py`` puts this directory on
``sys.path``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import time
from pathlib import Path
from typing import Callable

import torch

from megamoe.cli.launch import HelpFormatter
from megamoe.matmul_peak import choose_autocast, matmul_peak_tflops

__all__ = ["argument_parser", "HF_CUDA_ONLY", "BATCHED_MM_MEMORY_LIMIT", "NOISY_SPREAD", "keep_freed_memory_in_heap",
           "matmul_peaks", "time_call", "write_results"]

# transformers' experts implementations that need CUDA kernels, and why they are skipped here.
HF_CUDA_ONLY = {"deepgemm": "CUDA-only kernels (DeepGEMM)", "sonicmoe": "CUDA-only kernels (SonicMoE)"}
# batched_mm gathers one [2F+F, H] weight copy per (token, expert) pair: skip it above this size.
BATCHED_MM_MEMORY_LIMIT = 4 << 30
# A row's median / min step time above this: the host was busy while it ran (other processes only add
# time, so the minimum is the figure to judge by); the scripts warn.
NOISY_SPREAD = 1.3


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a benchmark script: ``--help`` shows its whole docstring and every default."""
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)


def matmul_peaks() -> dict:
    """The matmul peak per dtype measured on this CPU in this run (:mod:`megamoe.matmul_peak`), what
    ``--autocast auto`` picks from them, and whether this machine has fast bf16; printed, for the results."""
    peaks = {name: matmul_peak_tflops("cpu", dtype) * 1e3
             for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
    choice = choose_autocast(peaks["fp32"] / 1e3, peaks["bf16"] / 1e3)
    print("matmul peak GFLOP/s: " + ", ".join(f"{name} {value:.1f}" for name, value in peaks.items())
          + f"; --autocast auto picks {choice.reason}")
    if choice.autocast is None:
        print(f"NOTE: this machine has no fast bf16 (bf16 {choice.speedup:.2f}x fp32's matmul peak, under the "
              f"{choice.min_speedup:g}x auto asks for): the bf16 rows are reported anyway")
    return {"gflops": peaks, "bf16_over_fp32": choice.speedup, "auto_autocast": choice.autocast or "none",
            "fast_bf16": choice.autocast == "bf16"}


def keep_freed_memory_in_heap() -> str:
    """glibc: no mmap for large blocks, no trimming, so freed tensors are reused without page faults.
    Returns a description of the allocator setting for the results."""
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    mallopt = getattr(libc, "mallopt", None)
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    if mallopt is None or not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, -1)):
        return "default (mallopt unavailable)"
    return "glibc heap: M_MMAP_MAX=0, M_TRIM_THRESHOLD=-1"


def time_call(fn: Callable) -> float:
    """Seconds one call of ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_results(path: str | Path, results: dict) -> None:
    """Write ``results`` as JSON to ``path`` (its directory created) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
