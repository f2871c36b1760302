"""Checking the model fields of a checkpoint's manifest (:mod:`megamoe.checkpoint.manifest_fields`) against
each other and against the tensors it lists, before anything uses them.

:func:`megamoe.checkpoint.format.read_manifest` checks what the format itself defines (its digest, the
chunks tiling each tensor, file names, dtypes against byte counts); the generic format stores any JSON in
``model_config``, ``parallel_layout``, ``expert_placement`` and ``extra``. A model checkpoint (converted or
trained) gives them a meaning, checked here by :func:`check_model_manifest`, which every path reading
one calls (inspect, export-hf, reshard, verify, building a model for generation, resuming a run):

- ``model_config``: a JSON object and a valid :class:`GPTMoEConfig` of a known family;
- ``parallel_layout``: positive integer sizes whose product is the world that saved (as
  :func:`parallel_state.compute_rank_groups` requires), or empty (saved without one);
- ``expert_placement``: one valid placement per MoE layer of the config, of its experts and slots (every
  expert in some slot, ids in range: see :class:`ExpertPlacement`), or empty (the default placement);
- ``extra``: ``step`` an integer in [0, 2**63), ``sampler_state`` an object whose counters are such
  integers, ``has_optimizer_state`` a bool that says whether optimizer tensors are listed;
- ``tensors``: exactly the logical tensors the config defines, of its shapes, and with optimizer state
  the same state keys for the same parameters, each shaped like its parameter or a scalar.

Each problem is one :class:`CheckpointError` naming the field and the value. Values that are valid but
not the saved ones (a top-k of 3 for 2, a flipped bit in ``step``) are the manifest digest's to find.
Resuming a model that is not a :class:`GPTMoEModel` checks what holds for any model
(:func:`check_training_fields`): its own class defines its config and tensors.
"""

from __future__ import annotations

import json
import math
import os

from megamoe.checkpoint.errors import CheckpointError, ConversionError
from megamoe.checkpoint.layout_plan import logical_tensor_shapes
from megamoe.checkpoint.manifest import MANIFEST_FILE
from megamoe.checkpoint.manifest_fields import model_config_from_manifest, placements_from_manifest
from megamoe.lora.state import LORA_SUFFIXES
from megamoe.models import GPTMoEConfig, LayerSpec
from megamoe.models.families import SUPPORTED_FAMILIES

__all__ = ["check_model_manifest", "check_training_fields", "OPTIMIZER_PREFIX", "KNOWN_FAMILIES"]

OPTIMIZER_PREFIX = "optim."
KNOWN_FAMILIES = (*SUPPORTED_FAMILIES, "custom")
_LAYOUT_SIZES = ("world_size", "tp", "pp", "dp", "cp", "ep", "etp")
_COUNTER_LIMIT = 2**63                   # what an int64 holds: the counters become tensors and loop bounds
_SHAPES: dict[tuple, dict[str, tuple[int, ...]]] = {}       # see _shapes_of


def _counter(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _COUNTER_LIMIT


def _brief(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a whole config where an object belongs is not shown)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _shown(names, limit: int = 6) -> str:
    names = sorted(names)
    return ", ".join(repr(n) for n in names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_layout(manifest: dict, fail) -> None:
    layout = manifest.get("parallel_layout")
    if not isinstance(layout, dict):
        raise fail(f"parallel_layout must be a JSON object, got {_brief(layout)}")
    if not layout:
        return          # a checkpoint saved through save_checkpoint without one: any layout loads it
    for key in _LAYOUT_SIZES:
        value = layout.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(f"parallel_layout.{key} must be a positive integer, got {value!r}")
    world, tp, pp, dp, cp, ep, etp = (layout[k] for k in _LAYOUT_SIZES)
    if tp * pp * dp * cp != world or (world // pp) % (ep * etp):
        raise fail(f"parallel_layout {layout} is not a layout: tp*pp*dp*cp must be the world_size and ep*etp must "
                   "divide the ranks of a pipeline stage")
    if world != manifest["world_size"]:
        raise fail(f"parallel_layout.world_size is {world}, but the checkpoint was saved by "
                   f"{manifest['world_size']} ranks (world_size)")


def _check_placements(manifest: dict, config: GPTMoEConfig, fail) -> None:
    recorded = manifest.get("expert_placement")
    if not isinstance(recorded, dict):
        raise fail(f"expert_placement must be a JSON object, got {_brief(recorded)}")
    if not recorded:
        return          # none saved: loading builds the default placement
    expected = {str(layer) for layer in config.moe_layer_ids}
    if set(recorded) != expected:
        raise fail(f"expert_placement has layers {_shown(recorded)}, the model config's MoE layers are "
                   f"{_shown(expected)}")
    try:
        placements = placements_from_manifest(manifest)
    except ConversionError as e:
        raise fail(str(e)) from None
    for layer, placement in placements.items():
        ep = manifest["parallel_layout"].get("ep", placement.ep_size)
        if placement.ep_size != ep:
            raise fail(f"expert_placement[{str(layer)!r}] spreads its slots over {placement.ep_size} EP ranks, "
                       f"parallel_layout.ep is {ep}")
        # The slot count may differ from the config's: a placement recorded for another engine layout (an
        # expert-load plan for EP 4 x 12 slots, say) is used when a run picks that layout, ignored otherwise.
        if placement.num_experts != config.moe.num_experts:
            raise fail(f"expert_placement[{str(layer)!r}] places {placement.num_experts} experts, the model config "
                       f"has {config.moe.num_experts}")


def _check_extra(extra: dict, fail) -> None:
    if "step" in extra and not _counter(extra["step"]):
        raise fail(f"extra.step must be an integer in [0, 2**63), got {extra['step']!r}")
    sampler = extra.get("sampler_state")
    if sampler is not None:
        if not isinstance(sampler, dict):
            raise fail(f"extra.sampler_state must be a JSON object or null, got {_brief(sampler)}")
        for key, value in sampler.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not _counter(value):
                raise fail(f"extra.sampler_state.{key} must be an integer in [0, 2**63), got {value!r}")
    for key in ("has_optimizer_state", "verified_finite"):
        if key in extra and not isinstance(extra[key], bool):
            raise fail(f"extra.{key} must be true or false, got {extra[key]!r}")
    for key in ("training_state", "hf_config"):
        if key in extra and extra[key] is not None and not isinstance(extra[key], dict):
            raise fail(f"extra.{key} must be a JSON object, got {_brief(extra[key])}")


def _least_parameters(config: GPTMoEConfig) -> int:
    """A lower bound of the elements the tensors of a model of ``config`` hold, in O(1): its embedding,
    norms, routers and one of the matrices of each MLP / expert (attention, biases, the output layer and
    the other matrices left out: even weights packed two to a byte stay above it)."""
    H, layers = config.hidden_size, config.total_layers
    moe_layers = len(config.moe_layer_ids)
    total = config.vocab_size * H + layers * 2 * H
    if config.moe is not None:
        total += moe_layers * config.moe.num_experts * H * (1 + config.moe.ffn_hidden_size)
    if config.dense_mlp is not None:
        total += (layers - moe_layers) * config.dense_mlp.intermediate_size * H
    return total


def _check_size(config: GPTMoEConfig, listed: dict, model: set[str], fail) -> None:
    """Refuse a config larger than the tensors stored before a model of it is built to list its tensors
    (its layers allocate their full weights on the CPU: a vocabulary of 1e12 would end in the allocator,
    a million layers would take hours). Exact names and shapes are compared afterwards."""
    if config.total_layers > len(model):
        raise fail(f"model_config has {config.total_layers} layers, but the manifest lists only {len(model)} model "
                   "tensors")
    implied, stored = _least_parameters(config), sum(math.prod(listed[name]["global_shape"]) for name in model)
    if implied > stored:
        raise fail(f"model_config describes a model of at least {implied:,} parameters, but the checkpoint stores "
                   f"{stored:,}: vocab_size {config.vocab_size}, hidden_size {config.hidden_size}, num_layers "
                   f"{config.num_layers}")


def _model_tensors(manifest: dict, adapters: bool = False) -> dict[str, list]:
    """The model's logical tensors the manifest lists (not optimizer state; a LoRA run's adapters,
    :mod:`megamoe.lora`, which sit beside the base's, only with ``adapters``): name -> global shape."""
    return {n: t["global_shape"] for n, t in manifest["tensors"].items()
            if not n.startswith(OPTIMIZER_PREFIX) and (adapters or not n.endswith(LORA_SUFFIXES))}


def _shapes_of(config: GPTMoEConfig, layer_spec: LayerSpec | None) -> dict[str, tuple[int, ...]]:
    """:func:`logical_tensor_shapes`, remembered for the last few configs: building the model takes about
    a second for a 48-layer, 128-expert config, and generation and ``reshard`` check one manifest twice."""
    key = (json.dumps(config.to_dict(), sort_keys=True), layer_spec)
    if key not in _SHAPES:
        if len(_SHAPES) >= 4:
            _SHAPES.pop(next(iter(_SHAPES)))
        _SHAPES[key] = logical_tensor_shapes(config, layer_spec)
    return _SHAPES[key]


def _check_model_tensors(manifest: dict, config: GPTMoEConfig, layer_spec: LayerSpec | None, fail) -> None:
    listed = _model_tensors(manifest)
    _check_size(config, manifest["tensors"], set(listed), fail)
    try:
        shapes = _shapes_of(config, layer_spec)
    except ValueError as e:
        raise fail(f"model_config describes no model this megamoe builds: {e}") from None
    missing, unexpected = set(shapes) - set(listed), set(listed) - set(shapes)
    if missing or unexpected:
        raise fail(f"tensors does not hold the tensors of its model_config: {len(missing)} missing "
                   f"({_shown(missing)}), {len(unexpected)} unexpected ({_shown(unexpected)})")
    for name in sorted(listed):
        if tuple(listed[name]) != shapes[name]:
            raise fail(f"tensors[{name!r}] has global_shape {listed[name]}, the model_config gives "
                       f"{list(shapes[name])}")


def _check_optimizer_state(manifest: dict, fail) -> None:
    """Optimizer state (``optim.<key>.<parameter>``) of listed parameters, shaped like them or scalar, the
    same keys for the same parameters, and present exactly when ``extra.has_optimizer_state`` says so."""
    listed, by_key = _model_tensors(manifest, adapters=True), {}
    for name, entry in manifest["tensors"].items():
        if not name.startswith(OPTIMIZER_PREFIX):
            continue
        key, _, param = name[len(OPTIMIZER_PREFIX):].partition(".")
        if param not in listed:
            raise fail(f"tensors[{name!r}] is optimizer state of {param!r}, which the model does not have")
        if entry["global_shape"] not in (listed[param], []):
            raise fail(f"tensors[{name!r}] has global_shape {entry['global_shape']}: neither its parameter's "
                       f"{listed[param]} nor a scalar")
        by_key.setdefault(key, set()).add(param)
    has_state = (manifest.get("extra") or {}).get("has_optimizer_state", bool(by_key))
    if has_state != bool(by_key):
        raise fail(f"extra.has_optimizer_state is {str(has_state).lower()}, but the manifest lists "
                   f"{sum(len(p) for p in by_key.values())} optimizer state tensors")
    for key, params in by_key.items():
        for other, other_params in by_key.items():
            if other_params - params:
                raise fail(f"optimizer state {key!r} is missing for {len(other_params - params)} parameters that have "
                           f"{other!r}: {_shown(OPTIMIZER_PREFIX + key + '.' + p for p in other_params - params)}")


def _failing(checkpoint: str | os.PathLike):
    where = os.path.join(os.fspath(checkpoint), MANIFEST_FILE)
    return lambda problem: CheckpointError(f"{where}: {problem}")


def check_training_fields(manifest: dict, checkpoint: str | os.PathLike) -> None:
    """The checks of :func:`check_model_manifest` that hold whatever model saved the checkpoint:
    ``parallel_layout``, ``extra`` and the optimizer state. For a training checkpoint of a model that
    is not a :class:`GPTMoEModel` (any :class:`~megamoe.training.TrainableModel`), whose config and
    tensors only its own class knows (the strict load then refuses a missing or mis-shaped tensor)."""
    fail = _failing(checkpoint)
    _check_layout(manifest, fail)
    extra = manifest.get("extra")
    if not isinstance(extra, dict):
        raise fail(f"extra must be a JSON object, got {_brief(extra)}")
    _check_extra(extra, fail)
    _check_optimizer_state(manifest, fail)


def check_model_manifest(manifest: dict, checkpoint: str | os.PathLike, *,
                         layer_spec: LayerSpec | None = None) -> GPTMoEConfig:
    """The model config of the checkpoint ``checkpoint`` whose manifest (from ``read_manifest``) is
    ``manifest``, after checking every model field (see the module docstring); ``layer_spec``: the classes
    the model is built with (they choose its tensors). CheckpointError naming the field and value otherwise."""
    fail = _failing(checkpoint)
    if not isinstance(manifest.get("model_config"), dict):
        raise fail(f"model_config must be a JSON object, got {_brief(manifest.get('model_config'))}")
    try:
        config = model_config_from_manifest(manifest)
    except ConversionError as e:
        raise fail(str(e)) from None
    if config.family not in KNOWN_FAMILIES:
        raise fail(f"model_config.family {config.family!r} is not a family this megamoe knows: "
                   f"{', '.join(KNOWN_FAMILIES)}")
    check_training_fields(manifest, checkpoint)
    _check_placements(manifest, config, fail)
    _check_model_tensors(manifest, config, layer_spec, fail)
    return config
