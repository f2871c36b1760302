"""``inspect``: what a megamoe checkpoint holds, whether its files are intact, and whether any tensor
holds NaN or infinite values.

The value scan streams the logical tensors one at a time (:class:`LogicalTensorReader`, bounded memory),
each in blocks of :data:`_SCAN_BLOCK` elements, and runs only on files that passed verification (a
damaged file is reported as such, not read).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict


from checkpoint_tools.fp8_inspection import format_fp8, fp8_summary
from megamoe.checkpoint.errors import CheckpointError
from megamoe.checkpoint.integrity import check_stored_file
from megamoe.checkpoint.load import verify_checkpoint
from megamoe.checkpoint.logical_reader import LogicalTensorReader
from megamoe.checkpoint.manifest import _DTYPES, read_manifest, stored_entries
from megamoe.checkpoint.manifest_fields import HF_FILES_DIR, placements_from_manifest
from megamoe.checkpoint.model_manifest import OPTIMIZER_PREFIX, check_model_manifest
from megamoe.checkpoint.safetensors_stream import SAFETENSORS_DTYPES, read_data_extents
from megamoe.checkpoint.side_files import verify_side_files
from megamoe.precision import has_non_finite

__all__ = ["inspect_checkpoint", "format_inspection", "non_finite_tensors"]

_NAMED = 8                      # non-finite tensors named in the report


def non_finite_tensors(path: str | os.PathLike, manifest: dict | None = None) -> list[str]:
    """Names of the logical tensors (model and optimizer state) holding a NaN or an infinity, in manifest
    order; each file is verified before it is read (see :class:`LogicalTensorReader`)."""
    found = []
    with LogicalTensorReader(path, manifest) as reader:
        for name, entry in reader.manifest["tensors"].items():
            if _DTYPES[entry["dtype"]].is_floating_point and has_non_finite(reader.read(name)):
                found.append(name)
    return found


def _check_stored_dtypes(root: str, manifest: dict) -> None:
    """CheckpointError when a dtype the manifest gives is not the one its file stores (read from the
    safetensors headers, no data): a manifest that lies is refused like the other manifest checks, where
    a damaged file is reported. Files that cannot be read are left to the verification to report."""
    stored_dtypes: dict[str, list[tuple[str, str]]] = {}
    for entry, dtype in stored_entries(manifest):
        stored_dtypes.setdefault(entry["file"], []).append((entry["key"], dtype))
    for file_name, keys in sorted(stored_dtypes.items()):
        try:
            header = read_data_extents(check_stored_file(root, manifest, file_name))
        except (CheckpointError, OSError, ValueError):
            continue
        for key, dtype in keys:
            if key in header and header[key][0] != SAFETENSORS_DTYPES[_DTYPES[dtype]]:
                raise CheckpointError(f"{os.path.join(root, file_name)}: {key} is stored as {header[key][0]}, the "
                                      f"manifest says {dtype}")


def _placement_summary(placement) -> dict:
    counts = placement.replica_counts.tolist()
    slots = placement.slot_to_expert.tolist()
    per_rank = placement.num_slots // placement.ep_size
    return {"num_slots": placement.num_slots, "ep_size": placement.ep_size,
            "replicated": {str(e): c for e, c in enumerate(counts) if c > 1},
            "experts_per_rank": [slots[r * per_rank:(r + 1) * per_rank] for r in range(placement.ep_size)]}


def inspect_checkpoint(path: str | os.PathLike, *, verify: bool = True) -> dict:
    """A JSON-ready description: model, layout, placements (replica counts, experts per EP rank),
    parameter counts and bytes per dtype, optimizer state, files; with ``verify`` the result of checking
    every file's size, checksum and keys (and the side files) under ``"verification"`` and, when they
    pass, the tensors holding NaN or infinite values under ``"non_finite"`` (``count``, the first
    ``tensors`` by name; ``scanned`` False when damaged files kept the scan from running)."""
    manifest = read_manifest(path)
    root = os.fspath(path)
    if not os.path.isfile(os.path.join(root, "manifest.json")) and os.path.isdir(root + ".old"):
        root += ".old"
    config = check_model_manifest(manifest, root)
    _check_stored_dtypes(root, manifest)
    params = {"total": 0, "routed_experts": 0, "by_dtype": defaultdict(lambda: {"parameters": 0, "bytes": 0})}
    optimizer = {"tensors": 0, "bytes": 0, "state_keys": set()}
    for name, entry in manifest["tensors"].items():
        numel = math.prod(entry["global_shape"])
        nbytes = numel * _DTYPES[entry["dtype"]].itemsize
        if name.startswith(OPTIMIZER_PREFIX):
            optimizer["tensors"] += 1
            optimizer["bytes"] += nbytes
            optimizer["state_keys"].add(name[len(OPTIMIZER_PREFIX):].partition(".")[0])
            continue
        params["total"] += numel
        if ".mlp.experts." in name:
            params["routed_experts"] += numel
        params["by_dtype"][entry["dtype"]]["parameters"] += numel
        params["by_dtype"][entry["dtype"]]["bytes"] += nbytes
    moe = config.moe
    extra = manifest.get("extra") or {}
    info = {
        "path": os.path.abspath(root),
        "format_version": manifest["format_version"],
        "model": {"family": config.family, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
                  "num_layers": config.num_layers, "mtp_layers": config.mtp_num_layers,
                  "moe_layers": list(config.moe_layer_ids),
                  "num_experts": moe.num_experts if moe else 0, "top_k": moe.router.top_k if moe else 0,
                  "num_expert_slots": moe.num_expert_slots if moe else 0,
                  "dispatcher": moe.dispatcher if moe else None},
        "parallel_layout": manifest["parallel_layout"],
        "saved_by_ranks": manifest["world_size"],
        "expert_placement": {str(layer): _placement_summary(p)
                             for layer, p in sorted(placements_from_manifest(manifest).items())},
        "parameters": {**params, "by_dtype": dict(params["by_dtype"])},
        "block_fp8": fp8_summary({n: e["dtype"] for n, e in manifest["tensors"].items()
                                  if not n.startswith(OPTIMIZER_PREFIX)},
                                 None if config.weight_quantization is None else
                                 {"fmt": config.weight_quantization.fmt,
                                  "block_size": list(config.weight_quantization.block_size),
                                  "scale_fmt": config.weight_quantization.scale_fmt,
                                  "unquantized": config.weight_quantization.unquantized}),
        "optimizer_state": {**optimizer, "state_keys": sorted(optimizer["state_keys"])},
        "step": extra.get("step"),
        "hf_config": "hf_config" in extra,
        "side_files": sorted(extra.get("hf_files") or {}),
        "files": {"count": len(manifest["files"]), "bytes": sum(f["bytes"] for f in manifest["files"].values())},
    }
    if verify:
        problems = []
        try:
            verify_checkpoint(root)
        except CheckpointError as e:
            problems.append(str(e))
        problems += verify_side_files(os.path.join(root, HF_FILES_DIR), extra.get("hf_files") or {})
        info["verification"] = {"ok": not problems, "problems": problems}
        found = non_finite_tensors(root, manifest) if not problems else []
        info["non_finite"] = {"scanned": not problems, "count": len(found), "tensors": found[:_NAMED]}
    return info


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_inspection(info: dict) -> str:
    """The inspection as text for a terminal."""
    m, layout, p = info["model"], info["parallel_layout"], info["parameters"]
    lines = [
        f"checkpoint   {info['path']} (format v{info['format_version']}, step {info['step']})",
        f"model        {m['family']}: {m['num_layers']} layers"
        + (f" + {m['mtp_layers']} MTP" if m.get("mtp_layers") else "")
        + f", hidden {m['hidden_size']}, vocab {m['vocab_size']}; "
        f"MoE layers {m['moe_layers'] or 'none'}"
        + (f", {m['num_experts']} experts top-{m['top_k']}, {m['num_expert_slots']} slots, {m['dispatcher']}"
           if m["num_experts"] else ""),
        "layout       " + " ".join(f"{k}={layout[k]}" for k in ("tp", "pp", "ep", "etp", "dp", "cp") if k in layout)
        + f" (world size {layout.get('world_size')}, saved by {info['saved_by_ranks']} ranks)",
        f"parameters   {_count(p['total'])} ({_count(p['routed_experts'])} in routed experts)",
    ]
    for dtype, d in sorted(p["by_dtype"].items()):
        lines.append(f"  {dtype:<10} {_count(d['parameters'])} parameters, {_mib(d['bytes'])}")
    lines += format_fp8(info.get("block_fp8"))
    o = info["optimizer_state"]
    lines.append(f"optimizer    {o['tensors']} tensors ({', '.join(o['state_keys'])}), {_mib(o['bytes'])}"
                 if o["tensors"] else "optimizer    none")
    lines.append(f"files        {info['files']['count']} safetensors files, {_mib(info['files']['bytes'])}; HF config "
                 f"{'kept' if info['hf_config'] else 'absent'}; side files: {', '.join(info['side_files']) or 'none'}")
    for layer, pl in info["expert_placement"].items():
        replicated = ", ".join(f"e{e}x{c}" for e, c in pl["replicated"].items()) or "none"
        ranks = " | ".join(",".join(str(e) for e in experts) for experts in pl["experts_per_rank"])
        lines.append(f"layer {layer:<6} {pl['num_slots']} slots over EP {pl['ep_size']}; replicas: {replicated}; "
                     f"experts per EP rank: {ranks}")
    if "verification" in info:
        v = info["verification"]
        lines.append("checksums    OK" if v["ok"] else "checksums    FAILED\n  " + "\n  ".join(v["problems"]))
    if "non_finite" in info:
        nf = info["non_finite"]
        if not nf["scanned"]:
            lines.append("values       not scanned (damaged files)")
        elif not nf["count"]:
            lines.append("values       all finite")
        else:
            more = f" and {nf['count'] - len(nf['tensors'])} more" if nf["count"] > len(nf["tensors"]) else ""
            lines.append(f"values       NON-FINITE: {nf['count']} tensors hold NaN or Inf: "
                         f"{', '.join(nf['tensors'])}{more}")
    return "\n".join(lines)
