"""MXFP4 weights (OCP Microscaling, FP4 elements), as gpt-oss's releases store their routed experts.

A weight ``w`` of shape ``[..., n]`` (``n`` a multiple of 32) is cut into blocks of 32 consecutive values
along its last dim and stored as two uint8 tensors:

- ``*_blocks`` ``[..., n / 32, 16]``: the 32 FP4 (e2m1) elements of each block, two per byte, element
  ``2j`` in the LOW nibble and ``2j + 1`` in the high one (transformers 5.24, integrations/mxfp4.py);
- ``*_scales`` ``[..., n / 32]``: the block's shared scale, an e8m0 exponent with bias 127 (the value
  ``2^(s - 127)``; 255 is NaN in the spec).

An e2m1 nibble is ``sign | exponent (2 bits) | mantissa (1 bit)``: the magnitudes 0, 0.5, 1, 1.5, 2, 3,
4, 6 for codes 0-7, negated for 8-15. So ``w = fp4(nibble) * 2^(s - 127)``, exactly representable in
fp32 and bf16 (three significant bits). gpt-oss stores its experts in the HF layout ``gate_up_proj``
``[E, 2F, H]`` and ``down_proj`` ``[E, H, F]`` (one row per output feature, blocks along the input dim),
with ``config.json`` saying ``quantization_config = {"quant_method": "mxfp4", ...}``.

:func:`quantize_mxfp4` is the inverse for values that fit (used to build MXFP4 checkpoints in tests):
each block's scale is ``2^(floor(log2(amax)) - 2)`` (the spec's shared exponent, 2 being e2m1's largest
exponent) and each element rounds to the nearest e2m1 value (ties to even, saturating at 6).
"""

from __future__ import annotations

import torch

__all__ = ["MXFP4_BLOCK_SIZE", "FP4_E2M1_VALUES", "dequantize_mxfp4", "quantize_mxfp4", "mxfp4_shapes"]

MXFP4_BLOCK_SIZE = 32
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS = 127
_E2M1_MAX_EXPONENT = 2          # 6 = 1.5 * 2^2


def mxfp4_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks shape, scales shape) storing a weight of ``shape`` (last dim a multiple of 32)."""
    *prefix, n = shape
    if n % MXFP4_BLOCK_SIZE:
        raise ValueError(f"an MXFP4 weight's last dim must be a multiple of {MXFP4_BLOCK_SIZE}, got shape {shape}")
    groups = n // MXFP4_BLOCK_SIZE
    return (*prefix, groups, MXFP4_BLOCK_SIZE // 2), (*prefix, groups)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks`` uint8 [..., G, 16] and ``scales`` uint8 [..., G] -> the weight [..., G * 32] in ``dtype``
    (computed in fp32, exact). ValueError naming the mismatch for tensors that do not fit together."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK_SIZE // 2:
        raise ValueError(f"MXFP4 blocks must be [..., groups, {MXFP4_BLOCK_SIZE // 2}], got {tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"MXFP4 scales must be {tuple(blocks.shape[:-1])} (one per block of "
                         f"{tuple(blocks.shape)}), got {tuple(scales.shape)}")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)                         # [..., G, 32]
    exponents = scales.to(torch.int32) - _SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [..., n] -> (blocks uint8 [..., n / 32, 16], scales uint8 [..., n / 32]); see the module
    docstring. Values beyond 6 times their block's scale saturate."""
    blocks_shape, _ = mxfp4_shapes(tuple(weight.shape))
    w = weight.float().unflatten(-1, (blocks_shape[-2], MXFP4_BLOCK_SIZE))       # [..., G, 32]
    amax = w.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny))),
                           torch.zeros_like(amax)) - _E2M1_MAX_EXPONENT
    exponent = exponent.clamp(-_SCALE_BIAS, _SCALE_BIAS)
    scaled = torch.ldexp(w, -exponent.to(torch.int32).unsqueeze(-1))
    magnitudes = torch.tensor(FP4_E2M1_VALUES[:8], dtype=torch.float32, device=weight.device)
    distance = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - magnitudes).abs()      # [..., G, 32, 8]
    # Nearest magnitude; a tie goes to the even code (even mantissa bit), as round-to-nearest-even does.
    best = distance.min(dim=-1, keepdim=True).values
    candidates = torch.where(distance == best, torch.arange(8, device=weight.device), 8)
    even = torch.where(candidates % 2 == 0, candidates, 8).amin(dim=-1)
    codes = torch.where(even < 8, even, candidates.amin(dim=-1))
    codes = (codes | torch.where(torch.signbit(scaled) & (codes > 0), 8, 0)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + _SCALE_BIAS).to(torch.uint8)
