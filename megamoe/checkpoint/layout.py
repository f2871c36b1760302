"""The parallel layout a converted checkpoint is laid out for, and its manifest form.

The manifest's ``parallel_layout`` field has the keys training checkpoints write
(:mod:`megamoe.training.checkpoint`): ``world_size, tp, pp, dp, cp, ep, etp, order``. A conversion has
no real world: it records the smallest world holding the layout, ``pp * lcm(tp, ep * etp)`` ranks
(``dp`` follows). Chunks depend only on tp / pp / ep / etp (data-parallel copies hold the same chunks),
so the checkpoint loads unchanged under any data-parallel size, and under any other layout too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallel_state import DEFAULT_ORDER

from megamoe.checkpoint.errors import ConversionError

__all__ = ["ParallelLayout"]


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor, pipeline, expert and expert-tensor parallel sizes (context parallelism holds no weights)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConversionError(f"ParallelLayout.{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        """The smallest number of ranks that holds this layout: every pipeline stage needs ranks for
        tp and for ep * etp (EP may span data-parallel ranks)."""
        return self.pp * math.lcm(self.tp, self.ep * self.etp)

    def to_manifest(self) -> dict:
        world = self.world_size
        return {"world_size": world, "tp": self.tp, "pp": self.pp, "dp": world // (self.tp * self.pp), "cp": 1,
                "ep": self.ep, "etp": self.etp, "order": DEFAULT_ORDER}

    @classmethod
    def from_manifest(cls, fields: dict) -> "ParallelLayout":
        """The layout of a manifest's ``parallel_layout`` (written by a conversion or a training run)."""
        try:
            return cls(tp=fields["tp"], pp=fields["pp"], ep=fields["ep"], etp=fields["etp"])
        except KeyError as e:
            raise ConversionError(f"the manifest's parallel_layout {fields} has no {e.args[0]!r}") from None

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp} ep={self.ep} etp={self.etp}"
