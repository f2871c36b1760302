"""Block-scaled FP8 weights, as DeepSeek-V3 / R1, Kimi-K2, MiniMax-M2 and the Qwen3 / GLM FP8 releases store them.

A quantized weight ``w`` of shape ``[out, in]`` is stored as two tensors:

- ``<name>``: ``float8_e4m3fn`` values ``q``, same shape as ``w``;
- ``<name>_scale_inv``: one scale per ``block_size = (bo, bi)`` block (128 x 128 in every release),
  shape ``[ceil(out / bo), ceil(in / bi)]``; the blocks at the bottom and right edges are partial when
  ``out`` or ``in`` is not a multiple of the block. ``float32`` scales (``scale_fmt = "float"``, V3 style)
  or one-byte powers of two (``float8_e8m0fnu``, ``scale_fmt = "ue8m0"``).

and read back as ``w[i, j] = q[i, j] * scale_inv[i // bo, j // bi]``. (The name is DeepSeek's: the stored
value is the inverse of the scale that mapped the block onto the FP8 range.) HF's config.json says so with
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}``; the
modules listed in ``modules_to_not_convert`` (MiniMax: ``ignored_layers``) keep their unquantized weights.

In megamoe a quantized logical weight ``name`` has its scales under :func:`scale_inv_name` (``name +
"_scale_inv"``), for the tensors :func:`is_block_fp8_weight` names: the linear weights of attention, dense
MLPs, shared and routed experts (also of multi-token-prediction layers). Embeddings, the output layer,
norms and routers are never quantized.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

__all__ = ["BlockFP8Config", "block_scale_shape", "dequantize_block_fp8", "is_block_fp8_weight",
           "quantize_block_fp8", "scale_inv_name", "SCALE_INV_SUFFIX"]

SCALE_INV_SUFFIX = "_scale_inv"
_SCALE_FMTS = {"float": torch.float32, "ue8m0": torch.float8_e8m0fnu}
_FMTS = {"e4m3": torch.float8_e4m3fn}

# Logical names of the linear weights a block-FP8 release quantizes (suffix match, so that layers of any
# prefix, multi-token-prediction layers included, are covered).
_QUANTIZABLE = re.compile(
    r"(?:^|\.)(?:self_attn\.(?:q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight"
    r"|mlp\.(?:gate_proj|up_proj|down_proj)\.weight"
    r"|mlp\.shared_experts\.(?:gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)\.weight)$")


@dataclass(frozen=True)
class BlockFP8Config:
    """How a checkpoint's weights are block-quantized (see the module docstring).

    ``unquantized`` lists the logical weight names that :func:`is_block_fp8_weight` would quantize but
    that the checkpoint keeps unquantized (found from the HF ``modules_to_not_convert`` at import).
    """

    fmt: str = "e4m3"
    block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"                  # "float" (fp32 scales) | "ue8m0" (float8_e8m0fnu scales)
    unquantized: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.fmt not in _FMTS:
            raise ValueError(f"BlockFP8Config.fmt must be one of {sorted(_FMTS)}, got {self.fmt!r}")
        block = tuple(self.block_size) if isinstance(self.block_size, (list, tuple)) else None
        if block is None or len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                                       for b in block):
            raise ValueError(f"BlockFP8Config.block_size must be two positive integers, got {self.block_size!r}")
        object.__setattr__(self, "block_size", block)
        if self.scale_fmt not in _SCALE_FMTS:
            raise ValueError(f"BlockFP8Config.scale_fmt must be one of {sorted(_SCALE_FMTS)}, got {self.scale_fmt!r}")
        object.__setattr__(self, "unquantized", tuple(sorted(set(self.unquantized))))

    @property
    def weight_dtype(self) -> torch.dtype:
        return _FMTS[self.fmt]

    @property
    def scale_dtype(self) -> torch.dtype:
        return _SCALE_FMTS[self.scale_fmt]

    def quantizes(self, logical_name: str) -> bool:
        """Whether the checkpoint stores ``logical_name`` in FP8 with block scales."""
        return is_block_fp8_weight(logical_name) and logical_name not in self.unquantized

    @classmethod
    def from_hf(cls, quantization_config: Mapping[str, Any], unquantized: tuple[str, ...] = ()) -> BlockFP8Config:
        """The config of an HF ``quantization_config`` with ``quant_method == "fp8"``; ValueError naming
        the field that is not a supported block-FP8 layout."""
        method = quantization_config.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method {method!r} is not block FP8 ('fp8')")
        block = quantization_config.get("weight_block_size")
        if block is None:
            raise ValueError("quantization_config.weight_block_size is missing: per-tensor FP8 is not supported, "
                             "only block-scaled FP8 (weight_block_size [128, 128])")
        fmt = quantization_config.get("fmt", "e4m3")
        scale_fmt = quantization_config.get("scale_fmt") or "float"
        for name, value, known in (("fmt", fmt, _FMTS), ("scale_fmt", scale_fmt, _SCALE_FMTS)):
            if value not in known:
                raise ValueError(f"quantization_config.{name} {value!r} is not supported; supported: {sorted(known)}")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
        return cls(fmt=fmt, block_size=tuple(block), scale_fmt=scale_fmt, unquantized=tuple(unquantized))


def is_block_fp8_weight(logical_name: str) -> bool:
    """Whether ``logical_name`` is a linear weight that block-FP8 releases quantize (see the module docstring)."""
    return _QUANTIZABLE.search(logical_name) is not None


def scale_inv_name(logical_name: str) -> str:
    """The logical name of the block scales of the quantized weight ``logical_name``."""
    return logical_name + SCALE_INV_SUFFIX


def block_scale_shape(shape, block_size: tuple[int, int]) -> tuple[int, ...]:
    """``[..., ceil(rows / bo), ceil(cols / bi)]`` of a weight ``[..., rows, cols]``."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block_size[0]), math.ceil(cols / block_size[1]))


def _expand(scale_inv: torch.Tensor, shape, block_size: tuple[int, int]) -> torch.Tensor:
    """Every element's scale: each block's value repeated over the block, cut at the edges."""
    rows, cols = shape[-2:]
    expanded = scale_inv.float().repeat_interleave(block_size[0], dim=-2).repeat_interleave(block_size[1], dim=-1)
    return expanded[..., :rows, :cols]


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` per block, in fp32, then cast to ``dtype``; ``q`` is ``[..., rows, cols]``.

    The scales are spread over the columns only and broadcast over the rows of each block (about half
    the memory traffic of spreading them over every element: this runs per call for kept weights and
    is most of a dequantizing import's time)."""
    expected = block_scale_shape(q.shape, block_size)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"block scales have shape {tuple(scale_inv.shape)}; a weight of shape {tuple(q.shape)} "
                         f"with blocks {tuple(block_size)} needs {expected}")
    if q.is_meta:
        return torch.empty(q.shape, dtype=dtype, device="meta")
    bo, bi = block_size
    *lead, rows, cols = q.shape
    per_column = scale_inv.float().repeat_interleave(bi, dim=-1)[..., :cols]        # [..., R, cols]
    whole = rows // bo * bo                     # rows in whole blocks; the rest: one partial block
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if whole:
        values = q[..., :whole, :].float().unflatten(-2, (whole // bo, bo)).mul_(per_column[..., :whole // bo, None, :])
        out[..., :whole, :] = values.flatten(-3, -2)
    if whole < rows:
        out[..., whole:, :] = q[..., whole:, :].float().mul_(per_column[..., whole // bo:, :])
    return out


def quantize_block_fp8(w: torch.Tensor, block_size: tuple[int, int] = (128, 128), scale_fmt: str = "float",
                       fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of ``w`` ``[..., rows, cols]`` as DeepSeek quantizes its weights: each block's
    ``scale_inv = amax / fp8_max`` (rounded up to a power of two for ``ue8m0``), ``q = w / scale_inv``
    saturated to the format. An all-zero block gets ``scale_inv = 1``."""
    dtype = _FMTS[fmt]
    fp8_max = torch.finfo(dtype).max
    rows, cols = w.shape[-2:]
    bo, bi = block_size
    padded = torch.nn.functional.pad(w.float(), (0, -cols % bi, 0, -rows % bo))
    blocks = padded.unflatten(-1, (-1, bi)).unflatten(-3, (-1, bo))            # [..., R, bo, C, bi]
    amax = blocks.abs().amax(dim=(-3, -1))                                       # [..., R, C]
    scale_inv = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    elif scale_fmt != "float":
        raise ValueError(f"scale_fmt must be one of {sorted(_SCALE_FMTS)}, got {scale_fmt!r}")
    q = (w.float() / _expand(scale_inv, w.shape, block_size)).clamp(-fp8_max, fp8_max).to(dtype)
    return q, scale_inv.to(_SCALE_FMTS[scale_fmt])
