"""Adapter steps for block-FP8 weights: the HF side and the megamoe side may each store a quantizable
linear weight block-quantized (``float8_e4m3fn`` + ``*_scale_inv``, see :mod:`megamoe.quantization.block_fp8`)
or not, independently.

How the megamoe side stores it is the model config's ``weight_quantization``; how the HF side does is an
:class:`HFWeightForm` given to the adapter (by default: as the megamoe side). Each rename step of a
weight that either side quantizes becomes, per weight:

- both quantized: two renames (the e4m3 weight, its scales): ``--dtype keep`` import and export, bytes
  copied without being read;
- HF only (import with ``--dtype bf16|fp32|fp16``): one step (weight, scales) -> weight, dequantized
  into the form's ``dtype``; backwards it quantizes (DeepSeek's recipe);
- megamoe only (export of a kept checkpoint with ``--dtype bf16|fp32|fp16``): weight -> (weight,
  scales) the other way round.

The two inputs of a dequantizing step are one step's keys, so the import reads them one after the other
(:func:`~megamoe.hf.import_hf.hf_key_order`), and the result is built a band of block rows at a
time: memory is the output tensor plus one band, not fp32 copies of the whole weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.quantization.block_fp8 import (SCALE_INV_SUFFIX, BlockFP8Config, block_scale_shape,
                                            dequantize_block_fp8, quantize_block_fp8, scale_inv_name)

__all__ = ["HFWeightForm", "block_fp8_steps", "dequantize_in_bands"]

# Elements of a weight dequantized at a time (its fp32 temporaries: a few times 4 bytes each).
_BAND_ELEMENTS = 4 * 1024**2


@dataclass(frozen=True)
class HFWeightForm:
    """How HF files store the linear weights a block-FP8 release quantizes: ``quantization`` (None:
    unquantized), and the ``dtype`` weights are dequantized into on the way (the import's ``--dtype``
    when the HF side is quantized, the export's when the megamoe side is)."""

    quantization: BlockFP8Config | None
    dtype: torch.dtype = torch.float32


def dequantize_in_bands(q: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                        dtype: torch.dtype) -> torch.Tensor:
    """:func:`~megamoe.quantization.block_fp8.dequantize_block_fp8` of a 2-D weight, a band of whole block
    rows at a time: the fp32 temporaries are one band's, not the whole weight's."""
    if q.is_meta:
        return torch.empty(q.shape, dtype=dtype, device="meta")
    expected = block_scale_shape(q.shape, block_size)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"block scales have shape {tuple(scale_inv.shape)}; a weight of shape {tuple(q.shape)} "
                         f"with blocks {tuple(block_size)} needs {expected}")
    bo = block_size[0]
    rows, cols = q.shape
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    band = max(1, _BAND_ELEMENTS // max(1, bo * cols)) * bo
    for start in range(0, rows, band):
        stop = min(rows, start + band)
        out[start:stop] = dequantize_block_fp8(q[start:stop], scale_inv[start // bo:-(-stop // bo)], block_size, dtype)
    return out


def _quantize(w: torch.Tensor, config: BlockFP8Config) -> tuple[torch.Tensor, torch.Tensor]:
    if w.is_meta:
        return (torch.empty(w.shape, dtype=config.weight_dtype, device="meta"),
                torch.empty(block_scale_shape(w.shape, config.block_size), dtype=config.scale_dtype, device="meta"))
    return quantize_block_fp8(w, config.block_size, config.scale_fmt, config.fmt)


def block_fp8_steps(steps, logical: BlockFP8Config | None, hf: BlockFP8Config | None, dtype: torch.dtype,
                    rename_step, key_transform) -> list:
    """``steps`` with every rename of a weight that ``logical`` or ``hf`` quantizes rewritten (see the
    module docstring). ``rename_step(hf_key, logical_key, shape)`` and ``key_transform`` build steps
    (the adapter's own constructors). Steps that are not renames are kept as they are: the adapter
    only asks for the checkpoint form, where every quantizable weight is a rename."""
    if logical is None and hf is None:
        return list(steps)
    if logical is not None and hf is not None and (logical.block_size, logical.fmt) != (hf.block_size, hf.fmt):
        raise ValueError(f"the HF files' blocks {hf.block_size} ({hf.fmt}) differ from the checkpoint's "
                         f"{logical.block_size} ({logical.fmt}); re-quantizing is not supported")
    out = []
    for step in steps:
        name = step.logical_keys[0]
        on_logical = logical is not None and logical.quantizes(name)
        on_hf = hf is not None and hf.quantizes(name)
        if not step.is_rename or not (on_logical or on_hf):
            out.append(step)
            continue
        key, shape = step.hf_keys[0], step.hf_shapes[0]
        if on_logical and on_hf:
            out.append(step)
            out.append(rename_step(key + SCALE_INV_SUFFIX, scale_inv_name(name),
                                   block_scale_shape(shape, hf.block_size)))
        elif on_hf:
            out.append(_dequantizing(key_transform, key, name, shape, hf, dtype, hf_side=True))
        else:
            out.append(_dequantizing(key_transform, key, name, shape, logical, dtype, hf_side=False))
    return out


def _dequantizing(key_transform, key: str, name: str, shape, config: BlockFP8Config, dtype: torch.dtype,
                  hf_side: bool):
    """The step between a quantized (weight, scales) pair on one side (the HF one if ``hf_side``) and the
    plain weight on the other."""
    scales = block_scale_shape(shape, config.block_size)

    def dequantize(tensors):
        return [dequantize_in_bands(tensors[0], tensors[1], config.block_size, dtype)]

    def quantize(tensors):
        return list(_quantize(tensors[0], config))

    if hf_side:
        return key_transform((key, key + SCALE_INV_SUFFIX), (shape, scales), (name,), (shape,), dequantize, quantize,
                             what=f"dequantize block FP8 {key}")
    return key_transform((key,), (shape,), (name, scale_inv_name(name)), (shape, scales), quantize, dequantize,
                         what=f"dequantize block FP8 {name}")
