"""``export-hf``: a megamoe checkpoint -> a HuggingFace model directory ``from_pretrained`` loads.

Writes the keys ``save_pretrained`` of transformers 5.24 writes (the adapters' checkpoint form:
routed experts per expert, Mixtral's ``block_sparse_moe``), in ``model-0000i-of-0000n.safetensors``
shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json`` (one ``model.safetensors``
when everything fits), the original config.json kept in the manifest at import, and the side files.
Each expert is written once: the checkpoint stores one copy of each logical chunk, replicas included,
and a save that finds replicas differing fails (``save_checkpoint(..., verify_replicas=True)``).

A tensor that keeps its dtype and whose stored chunks hold its bytes in order (cut along the first
dimension only, or not cut) is copied file to file (see :mod:`megamoe.checkpoint.safetensors_stream`); the
others are assembled in memory. Every tensor's values are scanned for NaN and Inf as they are read (a
copied one is read for the scan only); one is refused by name unless ``allow_non_finite``. Each shard
is written and fsynced by its own threads, a finished one while the next one is being written.

The config.json and side files come from the checkpoint (kept there by ``import-hf`` and ``reshard``) or,
with ``hf_config_dir``, from a HF directory (e.g. the one a fine-tuned model was imported from, when its
training checkpoints were saved without :class:`megamoe.training.checkpoint.HFProvenance`); either way the
config must still map to the checkpoint's model config.
A checkpoint of family ``custom`` has no HF equivalent and cannot be exported; one of a supported family
without any HF config (trained from scratch) needs ``hf_config_dir``: writing a config.json from scratch
is not supported.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter

import torch
from tqdm import tqdm

from megamoe.checkpoint.errors import CheckpointError, ConversionError
from megamoe.checkpoint.finite_values import NonFiniteCheck
from megamoe.checkpoint.hf_checkpoint import CONFIG_FILE, INDEX_FILE, HFCheckpoint
from megamoe.checkpoint.logical_reader import LogicalTensorReader
from megamoe.checkpoint.manifest import _DTYPES, read_manifest
from megamoe.checkpoint.manifest_fields import HF_FILES_DIR
from megamoe.checkpoint.model_manifest import check_model_manifest
from megamoe.checkpoint.output_dir import OutputDirectory
from megamoe.checkpoint.safetensors_stream import FileExtent, PlannedTensor, SafetensorsStreamWriter, group_into_files
from megamoe.checkpoint.scratch import ScratchBuffer
from megamoe.checkpoint.side_files import copy_side_files
from megamoe.hf.adapters import ADAPTERS, AdapterError, HFAdapter, adapter_for
from megamoe.hf.block_fp8_steps import HFWeightForm
from megamoe.hf.hf_quantization import hf_quantization, without_quantization
from megamoe.hf.import_hf import model_config_from_hf
from megamoe.hf.lora_checkpoint import LORA_FILE, lora_checkpoint, merged_weights, read_adapters
from megamoe.hf.target_dtype import cast, target_dtype
from megamoe.lora import LORA_SUFFIXES
from megamoe.models import GPTMoEConfig
from megamoe.models.families import declared_mtp_layers
from megamoe.quantization.block_fp8 import SCALE_INV_SUFFIX, BlockFP8Config

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "export_hf", "check_hf_config_describes"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 50 * 1000**3      # transformers 5.24's save_pretrained default ("50GB")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)
# Engine choices, not part of the model: they may differ from what the HF config maps to.
_ENGINE_FIELDS = ("num_expert_slots", "dispatcher", "expert_backend", "input_sharded", "shared_expert_overlap",
                  "deterministic")
# How training balances the expert load: no weight depends on them, and a fine-tune may change them (a
# checkpoint imported before config_from_hf set the training coefficients records 0).
_TRAINING_ROUTER_FIELDS = ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "expert_bias_update_rate")


def _model_fields(config: GPTMoEConfig) -> dict:
    data = config.to_dict()
    data.pop("recompute", None)             # activation recomputation: how it was trained, not what it is
    data.pop("sequence_parallel", None)         # an engine choice too (how TP ranks split the work)
    data.pop("mtp_loss_coeff", None)            # how the MTP layers train, not what they are
    data.pop("make_vocab_size_divisible_by", None)   # the vocabulary padding: never saved
    data.pop("weight_quantization", None)       # how the weights are stored: config.json's quantization_config
    moe = data.get("moe") or {}
    for name in _ENGINE_FIELDS:
        moe.pop(name, None)
    for name in _TRAINING_ROUTER_FIELDS:
        (moe.get("router") or {}).pop(name, None)
    return data


def _differences(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys()) for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _hf_config(manifest: dict, config: GPTMoEConfig, checkpoint: str, hf_config_dir: str | None) -> dict:
    if config.family not in ADAPTERS:
        raise ConversionError(
            f"{checkpoint} holds a model of family {config.family!r}, which has no HuggingFace equivalent: it cannot "
            f"be exported (exportable families: {', '.join(ADAPTERS)})")
    if hf_config_dir is not None:
        where = os.path.join(hf_config_dir, CONFIG_FILE)
        try:
            with open(where, encoding="utf-8") as f:
                hf_config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConversionError(f"cannot read {where}: {e}") from None
    else:
        where = f"{checkpoint}: the stored HF config"
        hf_config = (manifest.get("extra") or {}).get("hf_config")
        if not hf_config:
            raise ConversionError(
                f"{checkpoint} holds no HuggingFace config (it was not imported with import-hf, e.g. trained from "
                "scratch, or saved by a training run without HFProvenance), so no config.json can be written for "
                "it; pass --hf-config with the HF directory whose config.json describes this model")
    check_hf_config_describes(hf_config, config, where, "the checkpoint's model")
    return dict(hf_config)


def check_hf_config_describes(hf_config: dict, config: GPTMoEConfig, where: str, what: str) -> None:
    """ConversionError unless the HF config.json dict ``hf_config`` maps to ``config`` (engine choices and
    training-only balancing coefficients aside); the message names the differing fields."""
    # A checkpoint may hold fewer MTP layers than config.json declares: none, when the HF checkpoint held no
    # MTP weights (import_hf.mtp_layers_to_import); the same config.json then describes it.
    try:
        declared = declared_mtp_layers(hf_config)
    except ValueError as e:
        raise ConversionError(f"{where}: {e}") from None
    mtp = config.mtp_num_layers if config.mtp_num_layers in (0, declared) else declared
    mapped = model_config_from_hf(hf_config, where, mtp_num_layers=mtp)
    differing = _differences(_model_fields(mapped), _model_fields(config))
    if differing:
        raise ConversionError(f"{where} does not describe {what} (differing fields: "
                              f"{', '.join(differing[:6])}); cannot write a matching config.json")


def _weight_form(adapter: HFAdapter, config: GPTMoEConfig, hf_config: dict, target: torch.dtype | None,
                 checkpoint: str) -> tuple[HFAdapter, dict]:
    """The adapter and the config.json of the export: a kept block-FP8 checkpoint exports as it was
    imported (``--dtype keep``: weights, scales and quantization_config as they are) or dequantized into
    ``target``, without a quantization_config; an unquantized checkpoint never has one (a checkpoint
    imported dequantized from an FP8 release keeps that release's config.json)."""
    quantization = config.weight_quantization
    if quantization is None or target is not None:
        form = None if quantization is None else HFWeightForm(None, target)
        return adapter.with_hf_weights(form), without_quantization(hf_config)
    where = f"{checkpoint}: the config.json to export"
    described = hf_quantization(hf_config, where)
    if not isinstance(described, BlockFP8Config) or (described.fmt, described.block_size) != (
            quantization.fmt, quantization.block_size):
        raise ConversionError(
            f"{where} does not describe the checkpoint's block-FP8 weights ({quantization.fmt}, blocks "
            f"{list(quantization.block_size)}): its quantization_config is {hf_config.get('quantization_config')!r}; "
            "export with --dtype bf16 (dequantized), or pass --hf-config with the FP8 release's directory")
    return adapter, hf_config


def _merged(apply, name: str, tensor: torch.Tensor) -> torch.Tensor:
    try:
        return apply(name, tensor).to(tensor.dtype)
    except ValueError as e:
        raise ConversionError(f"merging the LoRA adapters: {e}") from None


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "keep",
              overwrite: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              hf_config_dir: str | os.PathLike | None = None, progress: bool | None = None,
              verify_checksums: bool = True, allow_non_finite: bool = False, merge_lora: bool = False) -> dict:
    """Write the HF model directory ``out_dir`` for the megamoe checkpoint ``checkpoint``.

    ``dtype``: ``keep`` (each tensor as stored: bit-exact round trip of an import) | ``fp32`` | ``bf16`` |
    ``fp16``. ``hf_config_dir``: take config.json and the side files from this HF directory instead of
    the checkpoint. Optimizer state (``optim.*``) is not exported. Every checkpoint file read (and every
    side file) is checked against the manifest before its bytes are used, checksums included unless
    ``verify_checksums=False``. A weight holding NaN or Inf (each is scanned as it is read) is refused by
    name unless ``allow_non_finite`` (then a warning names it). A LoRA run's checkpoint (the base, its
    adapters and ``lora.json``: :mod:`megamoe.hf.lora_checkpoint`) exports only with ``merge_lora``: each
    adapted weight is written merged, ``W + alpha / r * B @ A`` in its stored dtype (not over kept block-FP8
    weights). Raises :class:`ConversionError` or :class:`~megamoe.checkpoint.format.CheckpointError` (nothing
    is left at ``out_dir``). Returns a summary.
    """
    checkpoint = os.fspath(checkpoint)
    hf_config_dir = None if hf_config_dir is None else os.fspath(hf_config_dir)
    target = target_dtype(dtype)
    output = OutputDirectory(out_dir, overwrite=overwrite, what="a HuggingFace model directory",
                             inputs=[checkpoint] + ([hf_config_dir] if hf_config_dir else []),
                             replaceable=lambda p: os.path.isfile(os.path.join(p, CONFIG_FILE)))
    manifest = read_manifest(checkpoint)
    config = check_model_manifest(manifest, checkpoint)
    hf_config = _hf_config(manifest, config, checkpoint, hf_config_dir)
    adapter, hf_config = _weight_form(adapter_for(config.family), config, hf_config, target, checkpoint)

    lora = lora_checkpoint(checkpoint, manifest)
    if lora is not None and not merge_lora:
        raise ConversionError(f"{checkpoint} is a LoRA run's checkpoint (its base and adapters): pass --merge-lora to "
                              "export the merged weights, or write the adapters for peft with export-peft")
    if lora is None and merge_lora:
        raise ConversionError(f"{checkpoint} holds no LoRA adapters: drop --merge-lora")
    if lora is not None and config.weight_quantization is not None:
        raise ConversionError(f"{checkpoint} keeps its base in block FP8: merging the adapters into FP8 weights would "
                              "round them away; export the adapters with export-peft")
    # Dry run on meta tensors: checks the names and shapes, and fixes the order and shapes of the HF keys.
    model_names = [n for n in manifest["tensors"] if not n.startswith("optim.") and not n.endswith(LORA_SUFFIXES)]
    order = {key: i for i, step in enumerate(adapter.transforms(config, fused=False)) for key in step.logical_keys}
    model_names.sort(key=lambda n: (order.get(n, len(order)), n))
    entries = manifest["tensors"]

    def meta(name):
        return torch.empty(entries[name]["global_shape"], dtype=_DTYPES[entries[name]["dtype"]], device="meta")

    try:
        planned = [PlannedTensor(key, cast(t.dtype, target), tuple(t.shape))
                   for key, t in adapter.iter_megamoe_to_hf(((n, meta(n)) for n in model_names), config, fused=False)]
    except AdapterError as e:
        raise ConversionError(f"{checkpoint} does not hold the tensors of its model config: {e}") from None
    shards = group_into_files(planned, max_shard_bytes)
    names = _shard_names(len(shards))
    file_of = {t.key: names[i] for i, shard in enumerate(shards) for t in shard}
    total = sum(t.nbytes for t in planned)
    by_bytes = Counter()
    for t in planned:               # config.json's dtype is that of the unquantized weights
        if t.dtype not in _FP8_DTYPES and not t.key.endswith(SCALE_INV_SUFFIX):
            by_bytes[t.dtype] += t.nbytes
    main_dtype = str(by_bytes.most_common(1)[0][0]).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in hf_config and hf_config[key] != main_dtype:
            logger.info("config.json: %s %s -> %s (the exported weights)", key, hf_config[key], main_dtype)
            hf_config[key] = main_dtype

    # Logical tensors that are an HF tensor under another name: copied from the checkpoint's files if the
    # dtype is kept and the stored chunks hold the bytes in order.
    renamed_to = adapter.renames(config)

    finite = NonFiniteCheck(checkpoint, allow=allow_non_finite, error=CheckpointError, doing="export")
    with output as tmp, LogicalTensorReader(checkpoint, manifest, verify_checksums=verify_checksums) as reader:
        writers: list[SafetensorsStreamWriter] = []
        casts = ScratchBuffer()
        copies: dict[str, tuple[torch.Tensor, list[FileExtent]]] = {}    # HF key -> (placeholder, its bytes)

        merged, merge = merged_weights(read_adapters(reader, lora), lora.config) if lora else (frozenset(), None)
        unknown = sorted(merged - set(model_names))
        if unknown:
            raise CheckpointError(f"{checkpoint}: the adapter {unknown[0]}.lora_A has no base weight {unknown[0]}")
        # The inputs of a step of several wait for each other, but the reader's buffer they may lie in is
        # reused by the next read: they are copied (a block-FP8 weight and its scales, gpt-oss's per-expert
        # tensors of one fused HF tensor).
        waiting = {key for step in adapter.transforms(config, fused=False) if len(step.logical_keys) > 1
                   for key in step.logical_keys}

        def items():
            for name in model_names:
                dtype = _DTYPES[entries[name]["dtype"]]
                extents = (reader.extents(name) if name in renamed_to and cast(dtype, target) == dtype
                           and name not in merged else None)
                tensor = reader.read(name)
                finite(name, tensor)        # a tensor copied file to file is read for this alone
                if name in merged:
                    tensor = _merged(merge, name, tensor)
                    finite(name, tensor)
                if extents is None:
                    yield name, tensor.clone() if name in waiting else tensor
                else:                           # shapes are all the adapter looks at
                    placeholder = meta(name)
                    copies[renamed_to[name]] = (placeholder, extents)
                    yield name, placeholder
        try:
            with tqdm(total=total, unit="B", unit_scale=True, desc="export-hf",
                      disable=None if progress is None else not progress) as bar:
                for key, tensor in adapter.iter_megamoe_to_hf(items(), config, fused=False):
                    if not writers or writers[-1].next_key is None:
                        if writers:
                            writers[-1].close()
                        writers.append(SafetensorsStreamWriter(os.path.join(tmp, names[len(writers)]),
                                                               shards[len(writers)], metadata={"format": "pt"},
                                                               checksum=False))
                    placeholder, extents = copies.pop(key, (None, None))
                    if placeholder is tensor:
                        writers[-1].write(key, tensor, extents)
                    else:
                        if cast(tensor.dtype, target) != tensor.dtype:
                            tensor = casts.copy_of(tensor, target)
                        writers[-1].write(key, tensor)
                    bar.update(tensor.numel() * tensor.element_size())
                writers[-1].close()
                for writer in writers:
                    writer.result.result()          # on disk
        except BaseException:
            for w in writers:
                w.abort()
            raise
        if len(shards) > 1:
            index = {"metadata": {"total_parameters": sum(t.nbytes // t.dtype.itemsize for t in planned),
                                  "total_size": total},
                     "weight_map": dict(sorted(file_of.items()))}
            with open(os.path.join(tmp, INDEX_FILE), "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        if hf_config_dir is not None:
            side = copy_side_files(hf_config_dir, HFCheckpoint.side_files_of(hf_config_dir), tmp)
        else:
            side = {name: entry for name, entry in ((manifest.get("extra") or {}).get("hf_files") or {}).items()
                    if name != LORA_FILE}        # the merged weights are no LoRA run
            if copy_side_files(os.path.join(reader.root, HF_FILES_DIR), list(side), tmp,
                               recorded=side if verify_checksums else None) != side:
                raise CheckpointError(f"{checkpoint}: the side files in {HF_FILES_DIR}/ do not match the manifest")
    logger.info("exported %s to %s: %d tensors in %d shards", checkpoint, output.path, len(planned), len(shards))
    return {"out_dir": output.path, "family": config.family, "tensors": len(planned), "shards": len(shards),
            "bytes": total, "side_files": sorted(side)}
