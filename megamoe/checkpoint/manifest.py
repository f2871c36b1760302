"""The megamoe checkpoint format's manifest: its constants, the dtype table, where a checkpoint lives
(``<path>.old`` after an interrupted save) and reading a manifest as untrusted input.

The format itself is documented in :mod:`megamoe.checkpoint.format`; this is what its save side
(:mod:`megamoe.checkpoint.save`) and read side (:mod:`megamoe.checkpoint.load`) share.
"""

from __future__ import annotations

import json
import logging
import math
import os

import torch

from megamoe.checkpoint.chunk_regions import _check_tiling
from megamoe.checkpoint.errors import CheckpointError
from megamoe.checkpoint.hf_checkpoint import is_weight_file
from megamoe.checkpoint.manifest_digest import check_digest
from megamoe.checkpoint.manifest_fields import HF_FILES_DIR
from megamoe.checkpoint.safe_names import resolve_inside

logger = logging.getLogger(__name__)

FORMAT_NAME = "megamoe-checkpoint"
FORMAT_VERSION = 3
# Version 1 recorded SHA-256 checksums; versions 1 and 2 carry no manifest digest (megamoe.checkpoint.manifest_digest).
_READABLE_VERSIONS = (1, 2, FORMAT_VERSION)
MANIFEST_FILE = "manifest.json"
MANIFEST_FIELDS = ("model_config", "parallel_layout", "expert_placement", "extra")
_OLD_SUFFIX = ".old"
_MAX_FIELD_DEPTH = 32        # a model config nests 4 levels, an HF config.json kept in extra a few more

# dtypes safetensors stores, by the name the manifest uses.
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e8m0fnu, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def resolve_checkpoint(path: str | os.PathLike) -> str:
    """The directory holding the checkpoint ``path`` names (``<path>.old`` after an interrupted swap)."""
    path = os.path.normpath(os.fspath(path))
    if os.path.isfile(os.path.join(path, MANIFEST_FILE)):
        return path
    old = path + _OLD_SUFFIX
    if not os.path.exists(path) and os.path.isfile(os.path.join(old, MANIFEST_FILE)):
        logger.warning("%s is missing but %s holds the previous checkpoint (a save was interrupted while "
                       "swapping directories); reading it", path, old)
        return old
    if os.path.exists(path):
        raise CheckpointError(f"{path} is not a megamoe checkpoint: it has no {MANIFEST_FILE}")
    raise CheckpointError(f"no checkpoint at {path}")


def _check_manifest_names(root: str, manifest_path: str, manifest: dict) -> None:
    """Every file name the manifest gives (its files, the chunks' and rank state's files, the HF side
    files) is a plain relative name resolving inside the checkpoint (see :mod:`megamoe.checkpoint.safe_names`),
    and every chunk's file is listed: refused here, before any file is opened."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{manifest_path}: 'files' must map file names to their sizes and checksums")
    for name in files:
        resolve_inside(root, name, f"{manifest_path}: files")
    stored = [(f"logical tensor {name!r}", c) for name, t in manifest["tensors"].items() for c in t["chunks"]]
    stored += [(f"rank {rank}'s state {key!r}", e) for rank, entries in manifest.get("rank_state", {}).items()
               for key, e in entries.items()]
    for what, entry in stored:
        if not isinstance(entry.get("file"), str) or entry["file"] not in files:
            raise CheckpointError(f"{manifest_path}: {what} is stored in {entry.get('file')!r}, which the manifest "
                                  "does not list among its files")
    side_files = (manifest.get("extra") or {}).get("hf_files") or {}
    # A linked hf_files/ must lead inside the checkpoint too: its files are checked against it below.
    side_dir = resolve_inside(root, HF_FILES_DIR, f"{manifest_path}: extra.hf_files") if side_files else root
    for name in side_files:
        resolve_inside(side_dir, name, f"{manifest_path}: extra.hf_files", single_component=True)
        if is_weight_file(name):      # export-hf writes these itself: a side file must not replace them
            raise CheckpointError(f"{manifest_path}: extra.hf_files names {name!r}, which is config.json or a "
                                  "weights file, not a side file")


def _sizes(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _check_manifest_types(manifest_path: str, manifest: dict) -> None:
    """The manifest's fields have the types the readers rely on (a manifest is untrusted input): the
    first one that does not is a CheckpointError naming it."""
    def malformed(what: str):
        return CheckpointError(f"{manifest_path} is malformed: {what}")

    manifest.setdefault("rank_state", {})
    for key in ("tensors", "files", "rank_state"):
        if not isinstance(manifest[key] if key in manifest else None, dict):
            raise malformed(f"{key!r} must be a JSON object")
    for name, info in manifest["files"].items():
        if not (isinstance(info, dict) and isinstance(info.get("bytes"), int) and info["bytes"] >= 0):
            raise malformed(f"files[{name!r}] must hold a non-negative 'bytes' count and a checksum")
    for name, entry in manifest["tensors"].items():
        if not (isinstance(entry, dict) and _sizes(entry.get("global_shape"))
                and isinstance(entry.get("chunks"), list)):
            raise malformed(f"logical tensor {name!r} needs a 'global_shape' of sizes >= 0 and a list of 'chunks'")
        if entry.get("dtype") not in _DTYPES:
            raise malformed(f"logical tensor {name!r} has unknown dtype {entry.get('dtype')!r}; known: "
                            f"{', '.join(sorted(_DTYPES))}")
        global_shape = entry["global_shape"]
        for chunk in entry["chunks"]:
            if not (isinstance(chunk, dict) and isinstance(chunk.get("key"), str) and _sizes(chunk.get("offsets"))
                    and _sizes(chunk.get("shape"))
                    and len(chunk["offsets"]) == len(chunk["shape"]) == len(global_shape)):
                raise malformed(f"a chunk of {name!r} needs a 'key', and 'offsets' and 'shape' of {len(global_shape)} "
                                "sizes >= 0")
            if any(o + s > g for o, s, g in zip(chunk["offsets"], chunk["shape"], global_shape)):
                raise malformed(f"a chunk of {name!r} at offsets {chunk['offsets']} of shape {chunk['shape']} lies "
                                f"outside its global shape {global_shape}")
    world_size = manifest.get("world_size")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise malformed(f"'world_size' must be a positive integer, got {world_size!r}")
    for rank, entries in manifest["rank_state"].items():
        if not (rank.isdigit() and int(rank) < world_size):
            raise malformed(f"rank_state names rank {rank!r}, not one of the {world_size} ranks that saved")
        if not isinstance(entries, dict):
            raise malformed(f"rank_state[{rank!r}] must be a JSON object")
        for key, entry in entries.items():
            if not (isinstance(entry, dict) and entry.get("dtype") in _DTYPES and isinstance(entry.get("key"), str)
                    and _sizes(entry.get("shape"))):
                raise malformed(f"rank_state[{rank!r}][{key!r}] needs a 'key', a known 'dtype' and a 'shape'")
    extra = manifest.get("extra")
    if extra is not None and not (isinstance(extra, dict) and isinstance(extra.get("hf_files", {}), dict)):
        raise malformed("'extra' must be a JSON object and its 'hf_files' one too")


def stored_entries(manifest: dict) -> list[tuple[dict, str]]:
    """Every stored tensor the manifest lists (the chunks of its logical tensors, then the rank state):
    (its entry, with ``file``, ``key`` and ``shape``; its dtype name)."""
    entries = [(c, t["dtype"]) for t in manifest["tensors"].values() for c in t["chunks"]]
    return entries + [(e, e["dtype"]) for per_rank in manifest["rank_state"].values() for e in per_rank.values()]


def _stored_bytes(manifest: dict) -> dict[str, int]:
    """Bytes of tensor data the manifest says each file holds (its dtypes times its shapes)."""
    stored: dict[str, int] = {}
    for entry, dtype in stored_entries(manifest):
        stored[entry["file"]] = stored.get(entry["file"], 0) + math.prod(entry["shape"]) * _DTYPES[dtype].itemsize
    return stored


def _check_unique_keys(manifest_path: str, manifest: dict) -> None:
    """Every stored entry names its own (file, key): two chunks reading one stored tensor is an edit."""
    seen: dict[tuple[str, str], str] = {}
    entries = [(f"logical tensor {name!r}", c) for name, t in manifest["tensors"].items() for c in t["chunks"]]
    entries += [(f"rank {rank}'s state {key!r}", e) for rank, per_rank in manifest["rank_state"].items()
                for key, e in per_rank.items()]
    for what, entry in entries:
        first = seen.get((entry["file"], entry["key"]))
        seen[entry["file"], entry["key"]] = what
        if first is not None:
            raise CheckpointError(f"{manifest_path} is malformed: {what} and {first} both read {entry['key']!r} "
                                  f"from {entry['file']}")


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's object hook: a key given twice (json keeps the last one silently) is an error."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"the key {duplicate!r} appears twice in one object")
    return result


def _parse_manifest(manifest_path: str):
    try:
        with open(manifest_path) as f:
            return json.load(f, object_pairs_hook=_no_duplicate_keys)
    except RecursionError:
        raise CheckpointError(f"cannot read {manifest_path}: its JSON is nested too deeply") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {manifest_path}: {e}") from e


def _check_depth(manifest_path: str, manifest: dict) -> None:
    """The caller's fields (MANIFEST_FIELDS, copied and walked recursively by their readers) nest at most
    :data:`_MAX_FIELD_DEPTH` levels; measured without recursion."""
    pending = [(manifest.get(f), 1) for f in MANIFEST_FIELDS]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, (dict, list)):
            if depth > _MAX_FIELD_DEPTH:
                raise CheckpointError(f"cannot read {manifest_path}: its JSON is nested too deeply (more than "
                                      f"{_MAX_FIELD_DEPTH} levels in its fields)")
            pending += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]


def _read_manifest_at(root: str) -> dict:
    manifest_path = os.path.join(root, MANIFEST_FILE)
    manifest = _parse_manifest(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{manifest_path} is not a {FORMAT_NAME} manifest")
    _check_depth(manifest_path, manifest)
    if manifest.get("format_version") not in _READABLE_VERSIONS:
        raise CheckpointError(f"{manifest_path}: unsupported checkpoint format version "
                              f"{manifest.get('format_version')!r}; this megamoe reads versions "
                              f"{', '.join(map(str, _READABLE_VERSIONS))}")
    check_digest(manifest_path, manifest)
    _check_manifest_types(manifest_path, manifest)
    # A manifest is untrusted input: a missing or mistyped field is an error naming the file, never a traceback.
    try:
        for name, entry in manifest["tensors"].items():
            _check_tiling(name, tuple(entry["global_shape"]),
                          [(tuple(c["offsets"]), tuple(c["shape"])) for c in entry["chunks"]],
                          f"{manifest_path}: the stored chunks")
        _check_manifest_names(root, manifest_path, manifest)
        _check_unique_keys(manifest_path, manifest)
        for file_name, stored in _stored_bytes(manifest).items():
            if stored > manifest["files"][file_name]["bytes"]:
                raise CheckpointError(f"{manifest_path}: its dtypes and shapes put {stored} bytes of tensor data in "
                                      f"{file_name}, which has {manifest['files'][file_name]['bytes']} bytes")
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointError(f"{manifest_path} is malformed: {type(e).__name__}: {e}") from None
    return manifest


def read_manifest(path: str | os.PathLike) -> dict:
    """The checkpoint's manifest (validated: format version, chunks tiling every tensor, every file name
    a plain name inside the checkpoint)."""
    return _read_manifest_at(resolve_checkpoint(path))
