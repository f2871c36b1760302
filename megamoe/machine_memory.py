"""The memory this machine has for a job, for refusing sizes that cannot fit before anything is allocated
(an allocator traceback or the kernel's OOM killer otherwise ends the run, often after minutes of work).

- CPU: ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can hand out without swapping: free memory
  plus reclaimable caches), else ``os.sysconf`` available pages; shared by every process of the node.
- CUDA: the device's free memory (``torch.cuda.mem_get_info``), one process per GPU.

An estimate that exceeds it cannot run; one below it may still fail (temporaries, fragmentation), so
callers refuse only the former.
"""

from __future__ import annotations

import os

import torch

__all__ = ["available_memory_bytes", "format_bytes"]


def available_memory_bytes(device: torch.device | str = "cpu") -> tuple[int | None, str]:
    """``(bytes, what)``: the memory available on ``device`` and how it was measured, for messages;
    bytes is None where it cannot be found out (the caller then checks nothing)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    if device.type != "cpu":        # meta (shapes only), or a device this module cannot ask
        return None, f"memory of {device} (unknown)"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory (MemAvailable)"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available host memory"
    except (ValueError, OSError, AttributeError):
        return None, "available host memory (unknown)"


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, 3 significant digits: ``1.5 GiB``, ``640 KiB``, ``3.2e+03 EiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} EiB"
