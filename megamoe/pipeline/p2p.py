"""A pipeline stage's point-to-point links to its previous and next stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from megamoe import comms

__all__ = ["StageP2P"]


@dataclass(frozen=True)
class StageP2P:
    """Moves activations forward and their gradients backward between neighbouring stages.

    Every exchange is one :func:`megamoe.comms.batch_send_recv`, so the paired calls of the 1F1B
    steady state (``send_forward_recv_backward`` on one side, ``send_backward_recv_forward`` on the
    other) cannot deadlock. ``prev_rank`` / ``next_rank`` are global ranks, None at the ends of the
    pipeline, where the corresponding calls do nothing and receives return None. Activations and
    gradients all have ``tensor_shape`` and ``dtype``.
    """

    group: ProcessGroup | None
    prev_rank: int | None
    next_rank: int | None
    tensor_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device | str | None = None

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)

    def _exchange(self, send: torch.Tensor | None, send_to: int | None, recv_from: int | None):
        sends = [(send, send_to)] if send_to is not None else []
        recvs = [(self._buffer(), recv_from)] if recv_from is not None else []
        received = comms.batch_send_recv(sends, recvs, self.group)
        return received[0] if received else None

    def recv_forward(self) -> torch.Tensor | None:
        """The next micro-batch's input activation from the previous stage (None on the first stage)."""
        return self._exchange(None, None, self.prev_rank)

    def send_forward(self, activation: torch.Tensor) -> None:
        self._exchange(activation, self.next_rank, None)

    def recv_backward(self) -> torch.Tensor | None:
        """The gradient of this stage's output from the next stage (None on the last stage)."""
        return self._exchange(None, None, self.next_rank)

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        self._exchange(input_grad, self.prev_rank, None)

    def send_forward_recv_backward(self, activation: torch.Tensor) -> torch.Tensor | None:
        """Send an output to the next stage and receive the gradient of an earlier output from it."""
        return self._exchange(activation, self.next_rank, self.next_rank)

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        """Send an input gradient to the previous stage and receive the next input from it."""
        return self._exchange(input_grad, self.prev_rank, self.prev_rank)
