"""One reusable CPU buffer for short-lived tensors.

A fresh large CPU tensor costs its page faults on first touch (on this kind of VM about as much as
copying it three times, see benchmarks/convert.py), and the allocator hands large blocks back to the OS
when they are freed, so a conversion allocating a new tensor for every chunk it cuts, assembles or casts
pays that cost on every byte. A :class:`ScratchBuffer` keeps one growing allocation instead.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ScratchBuffer"]


class ScratchBuffer:
    """``take(shape, dtype)``: an uninitialised contiguous tensor viewing the buffer. It stays valid only
    until the next ``take`` on the same buffer."""

    def __init__(self):
        self._storage = torch.empty(0, dtype=torch.uint8)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self._storage.numel():
            self._storage = torch.empty(0, dtype=torch.uint8)      # free the old block before the new one
            self._storage = torch.empty(nbytes, dtype=torch.uint8)
        return self._storage[:nbytes].view(dtype).view(shape)

    def copy_of(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``tensor`` (cast to ``dtype``) copied into the buffer."""
        out = self.take(tuple(tensor.shape), dtype or tensor.dtype)
        return out.copy_(tensor)
