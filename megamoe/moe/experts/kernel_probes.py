"""Probes for the optional kernels the expert backends use: each says why a kernel cannot run here
(a reason string) or that it can (None), and never raises, so a missing or mismatched kernel means a
fallback with a logged reason instead of a crash at the first GEMM.

- TransformerEngine: importing a TE built for another torch or CUDA raises ``OSError`` (a missing or
  mismatched shared library) or ``RuntimeError`` (its own version checks), not only ``ImportError``.
- ``torch._grouped_mm`` (the bf16 grouped GEMM of the ``torch`` backend): absent before torch 2.8
  (``setup.py`` allows 2.4); torch 2.8's CUDA kernel runs only on sm90; from 2.9 torch adds a fallback
  for other GPUs, which needs bf16 tensor cores (sm80).
- block-FP8 ``torch._scaled_mm`` (1x128 activation and 128x128 weight scales): torch dispatches these
  scales to cuBLASLt only on sm90 (Hopper; not Ada, not Blackwell's other scale layouts), with a CUDA
  (cuBLASLt) of at least 12.9.

Each reason is logged once per process, at WARNING, the first time a fallback is taken for it.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["block_scaled_mm_problem", "cuda_capability", "grouped_mm_problem", "log_fallback",
           "transformer_engine_problem"]

logger = logging.getLogger(__name__)

_GROUPED_MM_SM90_ONLY_BEFORE = (2, 9)        # torch 2.8's _grouped_mm: CUTLASS kernels for sm90 only
_BF16_MIN_CAPABILITY = (8, 0)
_HOPPER = (9, 0)
_BLOCK_SCALED_MM_MIN_CUDA = (12, 9)
_logged: set[str] = set()


def log_fallback(reason: str, fallback: str) -> None:
    """Log ``reason: fallback`` once per process (probes run per module or per call)."""
    message = f"{reason}: {fallback}"
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def _version(text: str | None) -> tuple[int, ...] | None:
    """``"2.9.1+cu128"`` -> (2, 9); None when there is no version (a CPU build's CUDA)."""
    if not text:
        return None
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s compute capability; None for a device that is not a usable CUDA GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def transformer_engine_problem() -> str | None:
    """Why ``transformer_engine.pytorch`` cannot be used (None: it imports)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return "TransformerEngine is not installed (`pip install .[te]`)"
    except (OSError, RuntimeError) as error:      # built for another torch / CUDA
        first_line = (str(error).strip().splitlines() or [""])[0]
        reason = f"TransformerEngine is installed but does not load ({type(error).__name__}: {first_line})"
        log_fallback(reason, "the expert backends run without it")
        return reason
    return None


def grouped_mm_problem(device: torch.device) -> str | None:
    """Why ``torch._grouped_mm`` cannot run bf16 GEMMs on ``device`` (None: it can). CPU is not asked
    (the per-slot loop is as fast there); ``meta`` stands in for a GPU (shapes only)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (torch >= 2.8 has)"
    if device.type != "cuda":
        return None
    capability = cuda_capability(device)
    if capability is None:
        return f"torch._grouped_mm needs a CUDA device ({device}: CUDA unavailable)"
    if (_version(torch.__version__) or (0,)) < _GROUPED_MM_SM90_ONLY_BEFORE:
        if capability[0] != _HOPPER[0]:
            return (f"torch {torch.__version__}'s torch._grouped_mm runs only on sm90, this GPU is compute capability "
                    f"{capability[0]}.{capability[1]} (torch >= 2.9 runs it from 8.0)")
    elif capability < _BF16_MIN_CAPABILITY:
        return (f"torch._grouped_mm needs bf16 tensor cores (compute capability >= 8.0), this GPU is "
                f"{capability[0]}.{capability[1]}")
    return None


def block_scaled_mm_problem(device: torch.device) -> str | None:
    """Why blockwise FP8 ``torch._scaled_mm`` (1x128 x 128x128 scales) cannot run on ``device`` (None: it can)."""
    capability = cuda_capability(device)
    if capability is None:
        return f"block-FP8 needs torch._scaled_mm on a CUDA GPU (device {device}, no usable CUDA GPU)"
    if capability[0] != _HOPPER[0]:
        return (f"block-FP8 torch._scaled_mm (1x128 x 128x128 scales) runs only on sm90 (Hopper); this GPU is "
                f"compute capability {capability[0]}.{capability[1]}")
    cuda = _version(torch.version.cuda)
    if cuda is None or cuda < _BLOCK_SCALED_MM_MIN_CUDA:
        return (f"block-FP8 torch._scaled_mm needs cuBLASLt >= 12.9; torch {torch.__version__} is built with CUDA "
                f"{torch.version.cuda}")
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    return None
