"""A LoRA run's checkpoint as the exports read it: the frozen base and the adapters (logical tensors
``<weight>.lora_A`` / ``.lora_B``, :func:`megamoe.lora.lora_state_dict`'s names) plus the side file ``lora.json``
(:mod:`megamoe.training.lora_run`: ``{"config": <LoRAConfig>, "base": {...}}``).

:func:`lora_checkpoint` says whether a checkpoint is one (and refuses one that holds adapters without their
``lora.json``, or the reverse); :func:`read_adapters` reads the full adapters (any saved layout);
:func:`merged_weights` is the edit ``export-hf --merge-lora`` applies to each adapted weight as it is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from megamoe.checkpoint.errors import CheckpointError
from megamoe.checkpoint.logical_reader import LogicalTensorReader
from megamoe.checkpoint.model_manifest import OPTIMIZER_PREFIX
from megamoe.checkpoint.side_files import read_side_file
from megamoe.lora import LORA_SUFFIXES, LoRAConfig, merge_lora

__all__ = ["LORA_FILE", "LoRACheckpoint", "lora_checkpoint", "read_adapters", "merged_weights"]

LORA_FILE = "lora.json"


@dataclass(frozen=True)
class LoRACheckpoint:
    """The LoRA part of a checkpoint: its config, the base it recorded (``{"hf_model": dir, "sha256": ...}`` or
    ``{"from_scratch_seed": n}``) and the names of its adapter tensors."""

    config: LoRAConfig
    base: dict
    adapter_names: tuple[str, ...]

    @property
    def base_hf_model(self) -> str | None:
        return self.base.get("hf_model")


def lora_checkpoint(checkpoint: str, manifest: dict) -> LoRACheckpoint | None:
    """The LoRA part of ``checkpoint`` (its ``manifest``), None for a checkpoint without adapters.
    CheckpointError when its adapters and its ``lora.json`` do not come together, or ``lora.json`` is damaged."""
    names = tuple(sorted(n for n in manifest["tensors"] if n.endswith(LORA_SUFFIXES)
                         and not n.startswith(OPTIMIZER_PREFIX)))
    recorded = (manifest.get("extra") or {}).get("hf_files") or {}
    saved = read_side_file(checkpoint, LORA_FILE) if LORA_FILE in recorded else None
    if saved is None and not names:
        return None
    if saved is None or not names:
        raise CheckpointError(f"{checkpoint} holds {'adapters' if names else LORA_FILE} but no "
                              f"{LORA_FILE if names else 'adapters'}: it is no LoRA run's checkpoint")
    try:
        record = json.loads(saved)
        config = LoRAConfig.from_json(json.dumps(record["config"]), f"{checkpoint}/{LORA_FILE}")
        base = record["base"]
        if not isinstance(base, dict):
            raise ValueError(f"base must be an object, got {base!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{checkpoint}/{LORA_FILE} is damaged: {e}") from None
    return LoRACheckpoint(config, base, names)


def read_adapters(reader: LogicalTensorReader, lora: LoRACheckpoint) -> dict[str, torch.Tensor]:
    """The full adapters of the checkpoint ``reader`` reads (every file checked as the reader checks it)."""
    adapters = {name: reader.read(name).clone() for name in lora.adapter_names}
    for name, tensor in adapters.items():
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{reader.root}: the adapter {name} holds NaN or Inf")
    return adapters


def merged_weights(adapters: dict[str, torch.Tensor], config: LoRAConfig):
    """``(names, apply)``: the logical weights the adapters change and ``apply(name, weight)``, the merged weight
    ``W + scaling * B @ A`` (:func:`megamoe.lora.merge_lora`, one weight at a time)."""
    names = frozenset(n.removesuffix(LORA_SUFFIXES[0]) for n in adapters if n.endswith(LORA_SUFFIXES[0]))

    def apply(name: str, weight: torch.Tensor) -> torch.Tensor:
        own = {name + suffix: adapters[name + suffix] for suffix in LORA_SUFFIXES if name + suffix in adapters}
        return merge_lora({name: weight}, own, config)[name]
    return names, apply
