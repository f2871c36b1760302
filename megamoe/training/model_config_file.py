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

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.model_loading import config_for_engine
from megamoe.hf.import_hf import model_config_from_hf
from megamoe.models import GPTMoEConfig

__all__ = ["ModelConfigFile", "read_model_config_file"]

# The fields that size a model in every supported family's config.json; the routed experts' count is named
# per family (Qwen / OLMoE, Mixtral / MiniMax / gpt-oss, DeepSeek / GLM).
_HF_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok")
_HF_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


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
        config, hf_config = model_config_from_hf(data, path), data       # an unsupported family fails here
        _require_hf_sizes(data, path)
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


def _require_hf_sizes(data: dict, path: str) -> None:
    """A config.json's missing fields take transformers' defaults, which are the family's full-size model
    (Qwen3-MoE's: 24 layers, 128 experts, a 151,936-token vocabulary): a model trained from scratch must
    state its size."""
    missing = [name for name in _HF_SIZE_FIELDS if name not in data]
    if not any(name in data for name in _HF_EXPERT_COUNT_FIELDS):
        missing.append(" or ".join(_HF_EXPERT_COUNT_FIELDS))
    if missing:
        raise ConversionError(
            f"model config {path} does not give the model's size: {', '.join(missing)} missing (transformers would "
            f"fill in the full-size defaults of {data['model_type']!r}); give every size field")


def _megamoe_fields(data: dict, path: str) -> GPTMoEConfig:
    fields = copy.deepcopy(data)
    attention = fields.get("attention")
    if isinstance(attention, dict) and "kind" not in attention:
        attention["kind"] = "mla" if "kv_lora_rank" in attention else "gqa"
    try:
        return GPTMoEConfig.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise ConversionError(f"model config {path}: {e}") from None
