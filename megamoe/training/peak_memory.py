"""The peak memory a training step reports, where the device reports one.

- CUDA: ``torch.cuda.max_memory_allocated`` (bytes held by tensors), reset at the start of each step
  by :func:`reset_peak_memory`: the step's own peak.
- CPU: the process's peak resident set size (``resource.getrusage``) since it started: not per step
  (the operating system keeps no resettable peak), and it counts everything the process holds (the
  Python interpreter, libraries, data), not only tensors.
- Anything else (or no ``resource`` module, e.g. Windows): None.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["peak_memory_bytes", "reset_peak_memory"]


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """See the module docstring."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "cpu":
        try:
            import resource
        except ImportError:
            return None
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)   # bytes on macOS, KiB elsewhere
    return None
