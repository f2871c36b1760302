"""Fill a model (one rank's shards) from full logical tensors, and gather them back on one process.

The logical tensors are what :mod:`megamoe.hf.adapters` makes of a HuggingFace state dict: full,
unsharded tensors named like :func:`megamoe.checkpoint_state.sharded_state_dict` (routed experts per
expert id). Each rank copies out the slices its chunks hold, so the same mapping serves every layout.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import nn

from megamoe.checkpoint_state import LogicalChunk, sharded_state_dict

__all__ = ["load_logical_state", "gather_logical_state", "chunks_by_name", "copy_into_chunks"]


def _region(chunk: LogicalChunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.shape))


@torch.no_grad()
def load_logical_state(model: nn.Module, logical: Mapping[str, torch.Tensor]) -> list[str]:
    """Copy into every chunk of ``sharded_state_dict(model)`` its slice of ``logical[chunk.name]``.

    Every name the model holds must be present with its global shape (ValueError naming the tensors
    otherwise); each is read from ``logical`` once however many chunks (replicas, tied copies) share it.
    Values are converted to each chunk's dtype. Returns the names of ``logical`` this model does not
    hold (sorted): other stages' or ranks' tensors when the mapping covers the whole model.
    """
    grouped = chunks_by_name(model)
    missing = sorted(name for name in grouped if name not in logical)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"{len(missing)} logical tensors the model holds are missing: {shown}")
    for name, chunks in grouped.items():
        copy_into_chunks(name, chunks, logical[name])
    return sorted(name for name in logical.keys() if name not in grouped)


def chunks_by_name(model: nn.Module) -> dict[str, list[LogicalChunk]]:
    """The chunks of ``sharded_state_dict(model)`` grouped by logical name (replicas and tied copies
    together): what this rank holds of each logical tensor."""
    grouped: dict[str, list[LogicalChunk]] = {}
    for chunk in sharded_state_dict(model):
        grouped.setdefault(chunk.name, []).append(chunk)
    return grouped


@torch.no_grad()
def copy_into_chunks(name: str, chunks: list[LogicalChunk], full: torch.Tensor) -> None:
    """Copy into each of ``chunks`` (of the logical tensor ``name``) its slice of the full tensor
    ``full``, converted to the chunk's dtype; ValueError when ``full`` has another shape."""
    if tuple(full.shape) != chunks[0].global_shape:
        raise ValueError(f"logical tensor {name!r} has shape {tuple(full.shape)}, the model expects "
                         f"{chunks[0].global_shape}")
    held, fp8 = chunks[0].tensor.dtype, (torch.float8_e4m3fn, torch.float8_e5m2)
    if held != full.dtype and (held in fp8 or full.dtype in fp8):
        # A cast into (or out of) FP8 values without their block scales is wrong, never a conversion.
        raise ValueError(f"logical tensor {name!r} is {full.dtype}, the model holds it as {held}: kept block-FP8 "
                         "weights load from the checkpoint's own FP8 values and scales (or import it dequantized)")
    for chunk in chunks:
        chunk.tensor.copy_(full[_region(chunk)])


@torch.no_grad()
def gather_logical_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every logical tensor of a model whose chunks cover them whole (a single process), as new tensors.

    ValueError naming a tensor that this process holds only part of (a multi-rank layout needs a
    checkpoint save instead, see :mod:`megamoe.checkpoint.format`).
    """
    gathered = {}
    for name, chunks in chunks_by_name(model).items():
        first = chunks[0]
        full = torch.empty(first.global_shape, dtype=first.tensor.dtype, device=first.tensor.device)
        covered = torch.zeros(first.global_shape, dtype=torch.bool)
        for chunk in chunks:
            full[_region(chunk)] = chunk.tensor
            covered[_region(chunk)] = True
        held = int(covered.sum())
        if held != math.prod(first.global_shape):
            raise ValueError(f"logical tensor {name!r}: this process holds {held} of its "
                             f"{math.prod(first.global_shape)} elements; gather_logical_state needs whole tensors")
        gathered[name] = full
    return gathered
