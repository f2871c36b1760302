"""The ``--dtype`` choice of the converter: keep each tensor's dtype, or cast floating tensors."""

from __future__ import annotations

import torch

__all__ = ["TARGET_DTYPES", "target_dtype", "cast"]

TARGET_DTYPES: dict[str, torch.dtype | None] = {
    "keep": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def target_dtype(choice: str) -> torch.dtype | None:
    try:
        return TARGET_DTYPES[choice]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(TARGET_DTYPES)}, got {choice!r}") from None


def cast(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is written in (integer tensors are never cast)."""
    return dtype if target is None or not dtype.is_floating_point else target
