"""gpt-oss's expert activation: a SwiGLU with clamped inputs, a sigmoid gain and a +1 on the up half.

For the gate half ``g`` and the up half ``u`` of one expert's first projection (transformers 5.24,
``GptOssExperts._apply_gate``)::

    g = min(g, limit);  u = clamp(u, -limit, limit)
    act = (u + 1) * g * sigmoid(alpha * g)

The clamps bound the activation the released weights were trained with (``limit`` 7, ``alpha``
1.702, "swiglu_limit" / "swiglu_alpha" in the HF config). The halves are stored as megamoe's experts
store every gated activation's, gate rows first then up rows (the HF checkpoint interleaves them
along its last dim; the adapter de-interleaves), so ``hidden.chunk(2, -1)`` splits them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ClampedSwiGLU"]


@dataclass(frozen=True)
class ClampedSwiGLU:
    """The activation's constants; ``forward`` / ``backward`` on [N, 2F] -> [N, F] (gate half first)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"ClampedSwiGLU.{name} must be > 0, got {value}")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Autograd-differentiable: [N, 2F] -> [N, F]."""
        gate, up = hidden.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def backward(self, grad_act: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """d(act)/d(hidden) for the fused expert MLP's hand-written backward: grad_act [N, F], hidden
        [N, 2F] -> [N, 2F]. Autograd of :meth:`forward` (the clamps' gradient convention included)."""
        with torch.enable_grad():
            h = hidden.detach().requires_grad_()
            grad, = torch.autograd.grad(self.forward(h), h, grad_act)
        return grad
