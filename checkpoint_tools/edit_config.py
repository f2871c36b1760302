"""``edit-config``: change a checkpoint's model config on purpose, the supported way.

A hand edit of ``manifest.json`` is refused on load (its digest no longer matches, see
:mod:`megamoe.checkpoint.manifest_digest`). :func:`edit_config` reads the manifest (its digest and fields
checked), sets the given ``model_config`` fields, checks the result as every load path does
(:func:`megamoe.checkpoint.model_manifest.check_model_manifest`: a valid config, matching the tensors
stored) and replaces ``manifest.json`` atomically with the new digest. Only ``model_config`` changes;
the data files are not touched.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from megamoe.atomic_file import atomic_write
from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.manifest import FORMAT_VERSION, MANIFEST_FILE, read_manifest, resolve_checkpoint
from megamoe.checkpoint.manifest_digest import manifest_text
from megamoe.checkpoint.model_manifest import check_model_manifest
from megamoe.checkpoint.save import fsync_dir

__all__ = ["parse_assignment", "edit_config"]


def parse_assignment(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (dotted key, value): the value as JSON (``3``, ``1e6``, ``true``, ``null``,
    ``[1, 2]``), else as the string it is (``family=qwen3_moe``). ValueError without ``=`` or a key."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"expected KEY=VALUE (e.g. moe.router.top_k=3), got {text!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


def _set(config: dict, key: str, value: Any) -> Any:
    """Set the dotted ``key`` of ``config`` to ``value``; returns the old value. Only existing fields."""
    *path, last = key.split(".")
    node = config
    for depth, part in enumerate(path):
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise ConversionError(f"model_config has no section {'.'.join(path[:depth + 1])!r} (setting {key!r})")
    if last not in node:
        raise ConversionError(f"model_config has no field {key!r}; its fields at that level: "
                              f"{', '.join(sorted(node))}")
    old, node[last] = node[last], value
    return old


def edit_config(checkpoint: str | os.PathLike, assignments: list[tuple[str, Any]]) -> list[tuple[str, Any, Any]]:
    """Set the ``model_config`` fields ``assignments`` ((dotted key, value), in order) of the checkpoint
    ``checkpoint`` and rewrite its manifest with a new digest. Returns (key, old value, new value) per
    assignment. ConversionError / CheckpointError (nothing written) when a key does not exist, the new
    config is invalid or no longer matches the stored tensors."""
    if not assignments:
        raise ConversionError("nothing to change: give at least one --set KEY=VALUE")
    root = resolve_checkpoint(checkpoint)
    manifest = read_manifest(root)         # its digest checked: a damaged or hand-edited manifest is not resealed
    edited = copy.deepcopy(manifest)
    if not isinstance(edited.get("model_config"), dict):
        raise ConversionError(f"{root} has no model_config to edit")
    changes = [(key, _set(edited["model_config"], key, value), value) for key, value in assignments]
    check_model_manifest(edited, root)
    edited["format_version"] = FORMAT_VERSION      # it now carries a digest
    with atomic_write(os.path.join(root, MANIFEST_FILE), "w") as f:
        f.write(manifest_text(edited))
    fsync_dir(root)
    return changes
