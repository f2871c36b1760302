"""How much memory a new allocation can take now, on the CPU or on this process's GPU: what a script
compares a memory estimate with before it allocates (a refusal in one line instead of an allocator
traceback or the OOM killer)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["available_memory_bytes"]

_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")          # cgroup v2: a container's memory.max and memory.current


def available_memory_bytes(device: torch.device | str = "cpu") -> int | None:
    """Free bytes on ``device``: a GPU's free memory (``torch.cuda.mem_get_info``); for the CPU the
    host's ``MemAvailable`` (Linux), lowered to the container's limit less its usage where a cgroup sets
    one. None where the system does not say (then nothing can be checked)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    host = _meminfo_available()
    container = _cgroup_available()
    known = [value for value in (host, container) if value is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024          # the kernel reports kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available() -> int | None:
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((_CGROUP / "memory.current").read_text()), 0)
    except (OSError, ValueError):
        return None
