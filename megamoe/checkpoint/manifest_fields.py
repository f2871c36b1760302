"""The manifest fields a converted checkpoint shares with training checkpoints, and reading them back.

Written by conversions (same keys as :mod:`megamoe.training.checkpoint`):

- ``model_config``: :meth:`GPTMoEConfig.to_dict` (training checkpoints store the same dict without the
  attention ``kind``; :func:`model_config_from_manifest` reads both);
- ``parallel_layout``: :meth:`ParallelLayout.to_manifest`;
- ``expert_placement``: ``{"<layer id>": ExpertPlacement.to_dict()}``;
- ``extra``: ``step`` (0 for an import), ``sampler_state`` (None), ``has_optimizer_state``, and for a
  checkpoint imported from HuggingFace ``hf_config`` (the original config.json, for export) and
  ``hf_files`` (tokenizer and other side files kept under ``hf_files/``: name -> checksum entry).
"""

from __future__ import annotations

import copy

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.layout import ParallelLayout
from megamoe.models import GPTMoEConfig
from megamoe.moe.placement.expert_slots import ExpertPlacement

__all__ = ["HF_FILES_DIR", "manifest_fields", "model_config_from_manifest", "placements_from_manifest"]

HF_FILES_DIR = "hf_files"


def manifest_fields(config: GPTMoEConfig, layout: ParallelLayout, placements: dict[int, ExpertPlacement],
                    extra: dict) -> dict[str, dict]:
    return {
        "model_config": config.to_dict(),
        "parallel_layout": layout.to_manifest(),
        "expert_placement": {str(layer): p.to_dict() for layer, p in sorted(placements.items())},
        "extra": extra,
    }


def model_config_from_manifest(manifest: dict) -> GPTMoEConfig:
    """The model config a checkpoint was saved with (converted or trained)."""
    data = copy.deepcopy(manifest.get("model_config") or {})
    if not data:
        raise ConversionError("the checkpoint's manifest has no model_config")
    attention = data.get("attention")
    if isinstance(attention, dict) and "kind" not in attention:
        # Training checkpoints store dataclasses.asdict(config): MLA is the attention with a KV LoRA rank.
        attention["kind"] = "mla" if "kv_lora_rank" in attention else "gqa"
    try:
        return GPTMoEConfig.from_dict(data)
    except ValueError as e:
        raise ConversionError(f"the checkpoint's model_config is not usable: {e}") from None
    except (TypeError, AttributeError, KeyError) as e:      # e.g. a list where a section's object belongs
        raise ConversionError(f"the checkpoint's model_config is malformed (a section that is not a JSON object?): "
                              f"{type(e).__name__}: {e}") from None


def placements_from_manifest(manifest: dict) -> dict[int, ExpertPlacement]:
    try:
        return {int(layer): ExpertPlacement.from_dict(d) for layer, d in manifest.get("expert_placement", {}).items()}
    except ValueError as e:
        raise ConversionError(f"the checkpoint's expert_placement is not usable: {e}") from None
