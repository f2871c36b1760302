"""The dtype of the numerically sensitive steps (norms, router, gates, the loss): at least fp32.

bf16 / fp16 inputs are computed in fp32; fp32 stays fp32; fp64 stays fp64. Casting to fp32
unconditionally would round an fp64 model's norms and loss to fp32, so that an fp64 run could not
tell rounding from a real difference (e.g. when comparing parallel layouts). The same rule decides how
:func:`has_non_finite` looks at a tensor: fp8 is read from its bits or widened (torch has no fp8
``isfinite``), nothing is narrowed (an fp64 value beyond fp32's range is finite).
"""

from __future__ import annotations

import torch

__all__ = ["compute_dtype", "upcast", "hold_in_compute_dtype_", "active_autocast_dtype", "in_autocast_dtype",
           "has_non_finite", "count_non_finite"]

_SCAN_BLOCK = 1 << 22      # elements checked at once: a widened fp8 block is 16 MiB, whatever the tensor
# fp8 dtype -> (mask, lowest masked byte that is NaN or Inf): read from the bits, as widening to fp32 costs
# 50 times more (0.11 GB/s on one thread). e4m3fn: S.1111.111 is NaN (no Inf); e5m2: S.11111.xx is Inf or
# NaN; e8m0fnu: 0xFF is NaN. The others are widened.
_FP8_NON_FINITE_BITS = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7F, 0x7C),
                        torch.float8_e8m0fnu: (0xFF, 0xFF)}


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The widest of ``dtypes`` and fp32."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`compute_dtype` of its dtype (``x`` itself when already that wide)."""
    return x.to(compute_dtype(x.dtype))


def hold_in_compute_dtype_(*params: torch.nn.Parameter | None) -> None:
    """Hold each floating parameter of ``params`` (None skipped) in :func:`compute_dtype` of its dtype, in place
    (``.data``): the gates that compute in fp32 (the routers', the shared experts') call it after
    ``nn.Module._apply``, so a bf16 model keeps them in fp32 and casts no weight per call."""
    for param in params:
        if param is not None and param.is_floating_point() and param.dtype != compute_dtype(param.dtype):
            param.data = param.data.to(compute_dtype(param.dtype))


def active_autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on ``device_type`` now; None where autocast is off there."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def in_autocast_dtype(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` (the first one the rows) cast to the autocast dtype of the rows' device when autocast is on
    there and they are in a wider floating type, as autocast casts a matmul's operands; else as they are. The
    casts are autograd ops: the gradients reach the originals in their own dtype. For the inputs of what
    autocast does not cast itself (``torch.mm(out=)``, ``torch._grouped_mm``) and for tokens about to cross
    the wire to such a GEMM (the MoE dispatch: half the bytes)."""
    dtype = active_autocast_dtype(tensors[0].device.type)
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype
                 and t.element_size() > torch.finfo(dtype).bits // 8 else t for t in tensors)


def has_non_finite(tensor: torch.Tensor) -> bool:
    """Whether the floating-point ``tensor`` holds a NaN or an infinity (False for other dtypes), checked
    block by block so that widening fp8 never copies the whole tensor."""
    if not tensor.is_floating_point():
        return False
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _SCAN_BLOCK):
        block = flat[start:start + _SCAN_BLOCK]
        if block.dtype in _FP8_NON_FINITE_BITS:
            mask, lowest = _FP8_NON_FINITE_BITS[block.dtype]
            if int(torch.bitwise_and(block.view(torch.uint8), mask).max()) >= lowest:
                return True
            continue
        # The minimum and maximum propagate NaN, and an infinity is one of them: one reduction without a
        # temporary, 15 to 100 times faster on CPU than isfinite().all() (measured on one thread of a loaded
        # 2-core VM: 6 to 21 GB/s against 0.14 to 0.37 for bf16 / fp32).
        extremes = torch.stack(torch.aminmax(block if block.element_size() > 1 else block.float()))
        if not bool(torch.isfinite(extremes).all()):
            return True
    return False


def count_non_finite(tensor: torch.Tensor) -> tuple[int, int]:
    """(NaN values, infinite values) of the floating-point ``tensor`` ((0, 0) for other dtypes), counted
    block by block as :func:`has_non_finite` scans."""
    if not tensor.is_floating_point():
        return 0, 0
    flat, nan, inf = tensor.reshape(-1), 0, 0
    for start in range(0, flat.numel(), _SCAN_BLOCK):
        block = flat[start:start + _SCAN_BLOCK]
        block = block if block.element_size() > 1 else block.float()
        nan += int(torch.isnan(block).sum())
        inf += int(torch.isinf(block).sum())
    return nan, inf
