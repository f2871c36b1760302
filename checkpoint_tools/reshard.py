"""``reshard``: a megamoe checkpoint (converted or trained) -> the same model under another parallel layout,
number of expert slots or placement, without going through HuggingFace.

Every logical tensor is read whole once (:class:`LogicalTensorReader`) and cut into the new layout's
chunks (:func:`plan_layout`) as it is written (:class:`CheckpointStreamWriter`). Optimizer state
(``optim.<state key>.<parameter name>``) follows its parameter: state shaped like the parameter is cut
like it, scalar state (``step``) stays one 0-dim tensor. Per-rank state (RNG states) is kept only when
the layout is unchanged (under another layout no rank continues a saved rank's streams). The manifest's
``extra`` (step, data position, HF config, side files) is carried over.
"""

from __future__ import annotations

import logging
import os

from tqdm import tqdm

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.layout import ParallelLayout
from megamoe.checkpoint.layout_plan import LayoutPlan, plan_layout
from megamoe.checkpoint.load import load_rank_state
from megamoe.checkpoint.logical_reader import LogicalTensorReader
from megamoe.checkpoint.manifest import _DTYPES, MANIFEST_FILE, read_manifest
from megamoe.checkpoint.manifest_fields import HF_FILES_DIR, manifest_fields, placements_from_manifest
from megamoe.checkpoint.model_loading import config_for_engine
from megamoe.checkpoint.model_manifest import OPTIMIZER_PREFIX, check_model_manifest
from megamoe.checkpoint.output_dir import OutputDirectory
from megamoe.checkpoint.placements import build_placements
from megamoe.checkpoint.side_files import copy_side_files
from megamoe.checkpoint.stream import CONVERSION_MAX_FILE_BYTES, CheckpointStreamWriter, StreamedTensor
from megamoe.hf.hf_sizes import check_layout_sizes

__all__ = ["reshard", "OPTIMIZER_PREFIX"]

logger = logging.getLogger(__name__)


def _regions(name: str, entry: dict, plan: LayoutPlan, checkpoint: str):
    """The new chunks of the stored logical tensor ``name``."""
    shape = tuple(entry["global_shape"])
    if not name.startswith(OPTIMIZER_PREFIX):
        return plan.tensors[name].regions
    state_key, _, param = name[len(OPTIMIZER_PREFIX):].partition(".")
    if param not in plan.tensors:
        raise ConversionError(f"{checkpoint}: optimizer state {name!r} ({state_key}) belongs to {param!r}, which the "
                              "model does not have")
    if shape == plan.tensors[param].global_shape:
        return plan.tensors[param].regions
    if shape == ():
        return (((), ()),)
    raise ConversionError(f"{checkpoint}: optimizer state {name!r} has shape {shape}: neither its parameter's "
                          f"{plan.tensors[param].global_shape} nor a scalar")


def reshard(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, layout: ParallelLayout, *,
            num_expert_slots: int | None = None, expert_load: str | os.PathLike | None = None,
            dispatcher: str | None = None, overwrite: bool = False, max_file_bytes: int = CONVERSION_MAX_FILE_BYTES,
            progress: bool | None = None, verify_checksums: bool = True) -> dict:
    """Write ``checkpoint`` as the checkpoint ``out_dir`` laid out for ``layout``.

    ``num_expert_slots`` / ``dispatcher``: new engine choices (default: the saved ones). Placement: balanced
    from ``expert_load``, else the saved one where slots and EP size are unchanged, else the default.
    Every file read (tensors, rank state, side files) is checked against the manifest before its bytes are
    used, checksums included unless ``verify_checksums=False``: a damaged checkpoint is refused, never
    rewritten with fresh checksums.
    Raises :class:`ConversionError` / :class:`~megamoe.checkpoint.format.CheckpointError`; nothing is left at
    ``out_dir`` then. Returns a summary.
    """
    checkpoint = os.fspath(checkpoint)
    output = OutputDirectory(out_dir, overwrite=overwrite, what="a megamoe checkpoint", inputs=[checkpoint],
                             replaceable=lambda p: os.path.isfile(os.path.join(p, MANIFEST_FILE)))
    manifest = read_manifest(checkpoint)
    try:
        config = config_for_engine(check_model_manifest(manifest, checkpoint), dispatcher=dispatcher,
                                   num_expert_slots=num_expert_slots)
    except ValueError as e:
        raise ConversionError(f"cannot apply the new engine choices: {e}") from None
    check_layout_sizes(config, layout)          # before the plan walks a world of that size
    placements = build_placements(config, layout.ep, expert_load=expert_load, saved=placements_from_manifest(manifest))
    plan = plan_layout(config, layout, placements)

    stored = manifest["tensors"]
    model_names = {n for n in stored if not n.startswith(OPTIMIZER_PREFIX)}
    missing, unexpected = sorted(set(plan.tensors) - model_names), sorted(model_names - set(plan.tensors))
    if missing or unexpected:
        raise ConversionError(f"{checkpoint} does not hold the tensors of its model config: missing {missing[:6]}, "
                              f"unexpected {unexpected[:6]}")
    for name in model_names:
        if tuple(stored[name]["global_shape"]) != plan.tensors[name].global_shape:
            raise ConversionError(f"{checkpoint}: {name!r} has shape {tuple(stored[name]['global_shape'])}, the model "
                                  f"config gives {plan.tensors[name].global_shape}")
    streamed = [StreamedTensor(name, _DTYPES[entry["dtype"]], tuple(entry["global_shape"]),
                               _regions(name, entry, plan, checkpoint)) for name, entry in stored.items()]

    new_layout = layout.to_manifest()
    keep_rank_state = manifest["parallel_layout"] == new_layout and bool(manifest["rank_state"])
    rank_state = []
    if keep_rank_state:
        rank_state = [(int(rank), key, _DTYPES[e["dtype"]], tuple(e["shape"]))
                      for rank, entries in sorted(manifest["rank_state"].items(), key=lambda kv: int(kv[0]))
                      for key, e in sorted(entries.items())]
    elif manifest["rank_state"]:
        logger.info("the layout changes: per-rank state (RNG states) is not carried over")

    extra = dict(manifest.get("extra") or {})
    with output as tmp, LogicalTensorReader(checkpoint, manifest, verify_checksums=verify_checksums) as reader:
        writer = CheckpointStreamWriter(tmp, streamed, rank_state=rank_state, max_file_bytes=max_file_bytes)
        try:
            with tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="reshard",
                      disable=None if progress is None else not progress) as bar:
                for t in streamed:
                    tensor = reader.read(t.name)
                    writer.write(t.name, tensor)
                    bar.update(tensor.numel() * tensor.element_size())
            for rank in sorted({r for r, _, _, _ in rank_state}):
                for key, tensor in sorted(load_rank_state(checkpoint, rank, verify_checksums=verify_checksums).items()):
                    writer.write_rank_state(rank, key, tensor)
            if extra.get("hf_files"):
                if copy_side_files(os.path.join(reader.root, HF_FILES_DIR), list(extra["hf_files"]),
                                   os.path.join(tmp, HF_FILES_DIR),
                                   recorded=extra["hf_files"] if verify_checksums else None) != extra["hf_files"]:
                    raise ConversionError(f"{checkpoint}: the side files in {HF_FILES_DIR}/ do not match the manifest")
            written = writer.finish(manifest_fields(config, layout, placements, extra), new_layout["world_size"])
        except BaseException:
            writer.abort()
            raise
    optimizer = sum(1 for t in streamed if t.name.startswith(OPTIMIZER_PREFIX))
    logger.info("resharded %s into %s (%s)", checkpoint, output.path, layout)
    return {"out_dir": output.path, "layout": new_layout, "logical_tensors": len(streamed),
            "optimizer_tensors": optimizer, "rank_state_kept": keep_rank_state, "files": len(written["files"]),
            "bytes": sum(f["bytes"] for f in written["files"].values())}
