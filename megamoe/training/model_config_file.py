"""A training run's model size from a JSON file (``--model-config FILE``), for a model trained from scratch.

Two schemas, told apart by their keys:

- **an HF config.json** (it has ``"model_type"``): any supported family
  (:data:`~megamoe.models.families.SUPPORTED_FAMILIES`), e.g. a Qwen3-MoE- or DeepSeek-V3-shaped model,
  mapped by :func:`~megamoe.models.families.config_from_hf` with the training balancing
  (``for_training=True``). The file itself is kept as the run's
  :class:`~megamoe.training.checkpoint.HFProvenance`, so the trained model exports to HF with it.
- **megamoe config fields** (it has ``"family"``): :meth:`GPTMoEConfig.to_dict`, the dict a megamoe
  checkpoint's manifest stores as ``model_config`` (the attention ``kind`` may be left out, as training
  checkpoints leave it: ``"mla"`` when the attention has a ``kv_lora_rank``, else ``"gqa"``). Its family
  may be ``"custom"`` (no HF equivalent: such a model cannot be exported). Such a file carries no HF
  config.

Either way the run's engine choices (dispatcher, expert slots, expert backend) replace the file's.
Errors name the file and the field.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

from checkpoint_tools.errors import ConversionError
from checkpoint_tools.import_hf import model_config_from_hf
from checkpoint_tools.model_loading import config_for_engine
from megamoe.models import GPTMoEConfig

__all__ = ["ModelConfigFile", "read_model_config_file"]


@dataclass(frozen=True)
class ModelConfigFile:
    """``config`` read from ``path``; ``hf_config`` is the file's dict when it is an HF config.json
    (None for megamoe config fields)."""

    path: str
    config: GPTMoEConfig
    hf_config: dict | None


def read_model_config_file(path: str | os.PathLike, *, dispatcher: str | None = None,
                           num_expert_slots: int | None = None,
                           expert_backend: str | None = None) -> ModelConfigFile:
    """The model config in the JSON file ``path`` (see the module docstring), with the engine choices
    given (None keeps the file's). Raises :class:`ConversionError` (a ValueError) naming the file and
    the field for a file that cannot be read or a config that is not usable."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"model config {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read model config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"model config {path} must hold a JSON object, got {type(data).__name__}")
    engine = dict(dispatcher=dispatcher, num_expert_slots=num_expert_slots, expert_backend=expert_backend)
    if "model_type" in data:
        config, hf_config = model_config_from_hf(data, path), data
    elif "family" in data:
        config, hf_config = _megamoe_fields(data, path), None
    else:
        raise ConversionError(
            f"model config {path} is neither an HF config.json (no \"model_type\") nor megamoe config fields (no "
            "\"family\"); give one of the two (see megamoe.training.model_config_file)")
    if num_expert_slots is not None and config.moe is None:
        raise ConversionError(f"model config {path}: num_expert_slots was given but the model has no MoE layers")
    try:
        config = config_for_engine(config, **engine)
    except ValueError as e:
        raise ConversionError(f"model config {path}: {e}") from None
    return ModelConfigFile(path, config, hf_config)


def _megamoe_fields(data: dict, path: str) -> GPTMoEConfig:
    fields = copy.deepcopy(data)
    attention = fields.get("attention")
    if isinstance(attention, dict) and "kind" not in attention:
        attention["kind"] = "mla" if "kv_lora_rank" in attention else "gqa"
    try:
        return GPTMoEConfig.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise ConversionError(f"model config {path}: {e}") from None
