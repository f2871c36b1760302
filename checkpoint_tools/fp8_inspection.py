"""What ``inspect`` says about block-FP8 weights, of a megamoe checkpoint or of an HF model directory.

Which tensors are FP8 is summarized by kind (the name with layer and expert indices replaced by ``*``):
a large model has tens of thousands of them, alike but for their indices.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter, defaultdict

from megamoe.checkpoint.hf_checkpoint import HFCheckpoint
from megamoe.quantization.block_fp8 import SCALE_INV_SUFFIX

__all__ = ["fp8_summary", "inspect_hf_directory", "format_hf_inspection", "format_fp8", "is_hf_directory"]

_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def _kind(name: str) -> str:
    return _INDEX.sub("*", name)


def fp8_summary(dtypes: dict[str, str], quantization: dict | None) -> dict | None:
    """``{"fmt", "block_size", "scale_fmt", "weights", "by_kind", "unquantized"}`` from the tensors' dtypes
    (name -> dtype name) and the recorded quantization (``fmt``, ``block_size``, ``scale_fmt``,
    ``unquantized``); None when no tensor is FP8."""
    weights = [n for n, d in dtypes.items() if d in _FP8_DTYPES]
    if not weights and not quantization:
        return None
    quantization = quantization or {}
    by_kind = Counter(_kind(n) for n in weights)
    scale_dtypes = sorted({dtypes[n + SCALE_INV_SUFFIX] for n in weights if n + SCALE_INV_SUFFIX in dtypes})
    return {"fmt": quantization.get("fmt"), "block_size": quantization.get("block_size"),
            "scale_fmt": quantization.get("scale_fmt"), "scale_dtypes": scale_dtypes, "weights": len(weights),
            "without_scales": sorted(n for n in weights if n + SCALE_INV_SUFFIX not in dtypes)[:8],
            "by_kind": dict(sorted(by_kind.items())),
            "unquantized": list(quantization.get("unquantized") or ())}


def format_fp8(fp8: dict | None) -> list[str]:
    if fp8 is None:
        return []
    block = "x".join(map(str, fp8["block_size"])) if fp8["block_size"] else "?"
    lines = [f"block FP8    {fp8['weights']} {fp8['fmt'] or ''} weights in {block} blocks, scales "
             f"{', '.join(fp8['scale_dtypes']) or 'none'} ({fp8['scale_fmt'] or '?'})"]
    lines += [f"  {count:>6} x {kind}" for kind, count in fp8["by_kind"].items()]
    if fp8["unquantized"]:
        shown = ", ".join(fp8["unquantized"][:4])
        lines.append(f"  unquantized: {shown}{' ...' if len(fp8['unquantized']) > 4 else ''} "
                     f"({len(fp8['unquantized'])})")
    if fp8["without_scales"]:
        lines.append(f"  WITHOUT SCALES: {', '.join(fp8['without_scales'])}")
    return lines


def inspect_hf_directory(path: str | os.PathLike) -> dict:
    """A JSON-ready description of an HF model directory: model type, bytes and tensors per dtype, and
    its block-FP8 weights (from the headers; no tensor data is read)."""
    hf = HFCheckpoint.open(path)
    by_dtype = defaultdict(lambda: {"tensors": 0, "parameters": 0, "bytes": 0})
    for info in hf.tensors.values():
        entry = by_dtype[str(info.dtype).removeprefix("torch.")]
        entry["tensors"] += 1
        entry["parameters"] += math.prod(info.shape)
        entry["bytes"] += info.nbytes
    quantization = hf.config.get("quantization_config")
    recorded = None
    if isinstance(quantization, dict):
        recorded = {"fmt": quantization.get("fmt", "e4m3"), "block_size": quantization.get("weight_block_size"),
                    "scale_fmt": quantization.get("scale_fmt") or "float",
                    "unquantized": [*(quantization.get("modules_to_not_convert") or ()),
                                    *(quantization.get("ignored_layers") or ())]}
    fp8 = fp8_summary({k: str(t.dtype).removeprefix("torch.") for k, t in hf.tensors.items()}, recorded)
    return {"path": os.path.abspath(hf.directory), "model_type": hf.config.get("model_type"),
            "quant_method": quantization.get("quant_method") if isinstance(quantization, dict) else None,
            "tensors": len(hf.tensors), "bytes": hf.total_bytes, "by_dtype": dict(by_dtype), "block_fp8": fp8,
            "side_files": hf.side_files}


def format_hf_inspection(info: dict) -> str:
    lines = [f"HF model     {info['path']}: {info['model_type']}, {info['tensors']} tensors, "
             f"{info['bytes'] / 2**20:.1f} MiB; quantization {info['quant_method'] or 'none'}"]
    for dtype, d in sorted(info["by_dtype"].items()):
        lines.append(f"  {dtype:<14} {d['tensors']} tensors, {d['parameters']} parameters, "
                     f"{d['bytes'] / 2**20:.1f} MiB")
    lines += format_fp8(info["block_fp8"])
    lines.append(f"side files   {', '.join(info['side_files']) or 'none'}")
    return "\n".join(lines)


def is_hf_directory(path: str | os.PathLike) -> bool:
    """A directory with a config.json and no megamoe manifest."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "manifest.json"))
