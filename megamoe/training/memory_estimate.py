"""The closed-form per-rank memory of training a :class:`~megamoe.models.GPTMoEConfig` under a layout.

(API draft; the formulas follow.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megamoe.models.config import GPTMoEConfig

if TYPE_CHECKING:
    from megamoe.transformer.recompute import RecomputeConfig

__all__ = ["MemoryEstimate", "StageEstimate", "estimate_memory"]


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage's per-rank bytes (the most loaded rank of the stage's EP group is the mean one:
    slots split evenly)."""

    stage: int
    layer_ids: tuple[int, ...]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int                 # saved for backward, all micro-batches in flight at the peak
    activation_bytes_per_micro_batch: int
    dense_param_count: int = 0
    expert_param_count: int = 0
    norm_activation_bytes: int = 0        # of activation_bytes_per_micro_batch: decoder norms (what SP splits)
    breakdown: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank estimate: ``stages`` (one per pipeline stage) and the most loaded one's fields."""

    stages: tuple[StageEstimate, ...]

    @property
    def worst(self) -> StageEstimate:
        return max(self.stages, key=lambda s: s.total)

    @property
    def param_bytes(self) -> int:
        return self.worst.param_bytes

    @property
    def grad_bytes(self) -> int:
        return self.worst.grad_bytes

    @property
    def optimizer_bytes(self) -> int:
        return self.worst.optimizer_bytes

    @property
    def activation_bytes(self) -> int:
        return self.worst.activation_bytes

    @property
    def total(self) -> int:
        return self.worst.total


def estimate_memory(config: GPTMoEConfig, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                    dp: int = 1, cp: int = 1, micro_batch: int = 1, seq_len: int = 2048,
                    num_micro_batches: int = 1, num_micro_batches_in_flight: int | None = None,
                    distributed_optimizer: bool = False, zero_stage: int = 1,
                    recompute: "RecomputeConfig | None" = None, sequence_parallel: bool = False,
                    param_dtype: torch.dtype | str = torch.float32, num_expert_slots: int | None = None,
                    pp_split=None) -> MemoryEstimate:
    """The per-rank memory of a training step of ``config`` under the layout (see the module docstring)."""
    raise NotImplementedError
