"""The LoRA configuration of a fine-tuning run: rank, alpha, dropout and which weights get adapters.

``scaling = alpha / rank`` (PEFT's default; no rsLoRA). Targets, by name:

- ``attention``: the attention projections (GQA ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; MLA ``q_proj``
  or ``q_a_proj`` / ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``);
- ``dense_mlp``: the dense MLPs' ``gate_proj``, ``up_proj``, ``down_proj``;
- ``shared_experts``: the MoE layers' shared experts (same three);
- ``experts``: every routed expert (one adapter per expert over its fused ``gate_up`` and its ``down``);
- ``router``: the MoE routers' gate weight (off by default).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = ["LoRAConfig", "LORA_TARGETS", "DEFAULT_LORA_TARGETS"]

LORA_TARGETS = ("attention", "dense_mlp", "shared_experts", "experts", "router")
DEFAULT_LORA_TARGETS = ("attention", "dense_mlp", "shared_experts", "experts")


@dataclass(frozen=True)
class LoRAConfig:
    """``rank`` >= 1, ``alpha`` > 0, ``dropout`` in [0, 1), ``targets`` a non-empty tuple of :data:`LORA_TARGETS`
    names (a comma-separated string is accepted and split). ValueError naming the field otherwise."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be an integer >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha must be a number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        targets = self.targets
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        targets = tuple(targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if not targets or unknown:
            raise ValueError(f"LoRAConfig.targets must name some of {', '.join(LORA_TARGETS)}, got "
                             f"{', '.join(map(repr, unknown)) if unknown else 'none'}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"LoRAConfig.targets names a target twice: {', '.join(targets)}")
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_json(self) -> str:
        """What ``lora.json`` holds."""
        return json.dumps({**asdict(self), "targets": list(self.targets)}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, what: str = "lora.json") -> "LoRAConfig":
        """Parse and validate ``lora.json`` (``what`` names it in errors)."""
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{what}: not JSON ({exc})") from None
        if not isinstance(fields, dict) or set(fields) - {"rank", "alpha", "dropout", "targets"} or not {
                "rank", "alpha"} <= set(fields):
            raise ValueError(f"{what}: expected an object with rank, alpha, dropout and targets, got {fields!r}")
        if "targets" in fields:
            if not isinstance(fields["targets"], list):
                raise ValueError(f"{what}: targets must be a list of names, got {fields['targets']!r}")
            fields["targets"] = tuple(fields["targets"])
        try:
            return cls(**fields)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
