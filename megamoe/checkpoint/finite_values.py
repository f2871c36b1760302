"""Weights holding NaN or infinite values, refused as they stream through an import, a load or an export.

A checkpoint or an HF release with such a weight computes NaN logits or losses from its first step, far
from the cause. Each tensor is scanned as it passes through (a view of the mapped file the conversion
reads, a chunk just loaded): one ``isfinite`` reduction per block. Only a tensor a conversion would copy
file to file without reading it is read for the scan alone, from the same mapping. The first tensor
found is refused by name with its counts, unless the user allows it (``--allow-non-finite``), which
warns once per such tensor instead.
"""

from __future__ import annotations

import logging

import torch

from megamoe.checkpoint.errors import ConversionError
from megamoe.precision import count_non_finite, has_non_finite

__all__ = ["ALLOW_FLAG", "NonFiniteCheck"]

logger = logging.getLogger(__name__)

ALLOW_FLAG = "--allow-non-finite"


class NonFiniteCheck:
    """``check(name, tensor)``: raise ``error`` naming ``name``, its NaN and infinite counts and ``source``
    when the tensor holds any; with ``allow``, log a warning instead (and count it in ``found``)."""

    def __init__(self, source: str, *, allow: bool = False, error: type[Exception] = ConversionError,
                 doing: str = "import"):
        self.source, self.allow, self.error, self.doing = source, allow, error, doing
        self.found: list[str] = []

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if not has_non_finite(tensor):
            return
        nan, inf = count_non_finite(tensor)
        what = f"{name} holds {nan} NaN and {inf} infinite values (of {tensor.numel()})"
        self.found.append(name)
        if not self.allow:
            raise self.error(f"{self.source}: {what}; refusing to {self.doing} non-finite weights (pass "
                             f"{ALLOW_FLAG} to {self.doing} them anyway)")
        logger.warning("%s: %s; kept as they are (%s)", self.source, what, ALLOW_FLAG)
