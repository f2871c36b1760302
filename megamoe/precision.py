"""The dtype of the numerically sensitive steps (norms, router, gates, the loss): at least fp32.

bf16 / fp16 inputs are computed in fp32; fp32 stays fp32; fp64 stays fp64. Casting to fp32
unconditionally would round an fp64 model's norms and loss to fp32, so that an fp64 run could not
tell rounding from a real difference (e.g. when comparing parallel layouts).
"""

from __future__ import annotations

import torch

__all__ = ["compute_dtype", "upcast"]


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The widest of ``dtypes`` and fp32."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`compute_dtype` of its dtype (``x`` itself when already that wide)."""
    return x.to(compute_dtype(x.dtype))
