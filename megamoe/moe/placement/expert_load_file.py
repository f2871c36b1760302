"""The expert-load file: per-layer token counts per expert, written by inference and read by
``megamoe-convert import-hf --expert-load FILE`` to build balanced placements."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import torch

from megamoe.atomic_file import atomic_write
from megamoe.moe.placement.argument_checks import positive_int, validated_load

__all__ = ["EXPERT_LOAD_FORMAT", "EXPERT_LOAD_VERSION", "load_expert_load", "save_expert_load"]

EXPERT_LOAD_FORMAT = "megamoe-expert-load"
EXPERT_LOAD_VERSION = 1


def save_expert_load(
    path: str | os.PathLike,
    loads: Mapping[int, Sequence[float] | torch.Tensor],
    *,
    num_experts: int,
    metadata: dict | None = None,
) -> None:
    """Write per-layer expert loads as JSON (format ``megamoe-expert-load`` v1), atomically.

    ``loads`` maps a layer index to its [E] load (token counts or fractions). The file is written to a
    temporary file next to ``path`` and renamed over it, so a reader never sees a half-written file.
    """
    num_experts = positive_int(num_experts, "num_experts")
    if not isinstance(loads, Mapping) or not loads:
        raise ValueError("loads must be a non-empty dict {layer index: per-expert loads}")
    layers = {}
    for layer in sorted(loads, key=lambda k: (not isinstance(k, int), str(k))):
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer keys must be non-negative ints (layer indices), got {layer!r}")
        layers[str(layer)] = validated_load(loads[layer], num_experts, f"loads[{layer}]").tolist()
    document = {
        "format": EXPERT_LOAD_FORMAT,
        "version": EXPERT_LOAD_VERSION,
        "num_experts": num_experts,
        "layers": layers,
        "metadata": {} if metadata is None else metadata,
    }
    if not isinstance(document["metadata"], dict):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        text = json.dumps(document, allow_nan=False, indent=1)
    except (TypeError, ValueError) as error:
        raise ValueError(f"metadata is not JSON-serialisable ({error}); use plain str/int/float/list/dict") from None

    with atomic_write(path, "w") as file:
        file.write(text)


def load_expert_load(path: str | os.PathLike) -> dict[int, torch.Tensor]:
    """Read an expert-load file: layer index -> [E] float64 loads. ValueError says what is wrong and where."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as file:
        text = file.read()
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); expected a megamoe-expert-load file") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {type(document).__name__}")
    if document.get("format") != EXPERT_LOAD_FORMAT:
        raise ValueError(
            f"{path}: 'format' is {document.get('format')!r}, expected {EXPERT_LOAD_FORMAT!r}; "
            f"is this an expert-load file written by save_expert_load?"
        )
    if document.get("version") != EXPERT_LOAD_VERSION:
        raise ValueError(
            f"{path}: unsupported version {document.get('version')!r}; this megamoe reads version {EXPERT_LOAD_VERSION}"
        )
    num_experts = document.get("num_experts")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{path}: 'num_experts' must be a positive int, got {num_experts!r}")
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: 'metadata' must be an object, got {type(metadata).__name__}")
    layers = document.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{path}: 'layers' must be a non-empty object {{\"layer index\": [loads]}}")
    result = {}
    for key, values in layers.items():
        if not (key.isascii() and key.isdigit() and str(int(key)) == key):
            raise ValueError(f"{path}: layer key {key!r} is not a layer index; keys are decimal ints like \"3\"")
        if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            raise ValueError(f"{path}: layer {key} must be a list of numbers")
        result[int(key)] = validated_load(values, num_experts, f"{path}: layer {key}")
    return dict(sorted(result.items()))
