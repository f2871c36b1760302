"""``import-hf``: a HuggingFace model directory -> a megamoe checkpoint laid out for a parallel layout.

Order of work (nothing is written before every check has passed):

1. Open the HF directory (:class:`HFCheckpoint`: headers, index, dtypes), map config.json to a
   :class:`GPTMoEConfig` (:func:`config_from_hf`), choose the expert placements and plan the layout's
   chunks (:func:`plan_layout`, which runs the model's own layout checks).
2. Dry run: the family's adapter converts the HF keys as meta tensors (shapes and dtypes only), which
   reports every missing, unexpected or mis-shaped tensor and fixes the order tensors are produced in.
3. Stream: each HF tensor is read once (a view of the mapped file), scanned for NaN and Inf (refused
   unless ``allow_non_finite``), converted by the adapter, cast if asked, cut into the layout's chunks
   and appended to the output files, whose headers were planned in step 2 (:class:`CheckpointStreamWriter`).
   A tensor the adapter only renames and that keeps its dtype is only scanned for its chunks that are
   runs of its bytes: those are copied file to file. Memory: about one tensor and the read window.
4. Copy the side files (tokenizer, ...), write the manifest, rename the directory into place.

Block-FP8 releases (``quantization_config.quant_method == "fp8"``, checked against the files by
:func:`hf_weights_adapter`): ``--dtype keep`` keeps the e4m3 weights and their block scales (the model
config gets ``weight_quantization``; both are renames, copied as in step 3); ``--dtype bf16|fp32|fp16``
dequantizes each weight with its scales on the way (:mod:`megamoe.hf.block_fp8_steps`) into an
ordinary checkpoint. Other quantization methods are refused (:mod:`megamoe.hf.hf_quantization`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os

import torch
from tqdm import tqdm

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.finite_values import NonFiniteCheck
from megamoe.checkpoint.format import MANIFEST_FILE
from megamoe.checkpoint.hf_checkpoint import HFCheckpoint
from megamoe.checkpoint.layout import ParallelLayout
from megamoe.checkpoint.layout_plan import plan_layout
from megamoe.checkpoint.manifest_fields import HF_FILES_DIR, manifest_fields
from megamoe.checkpoint.output_dir import OutputDirectory
from megamoe.checkpoint.placements import build_placements
from megamoe.checkpoint.read_window import ReadWindow
from megamoe.checkpoint.scratch import ScratchBuffer
from megamoe.checkpoint.side_files import copy_side_files
from megamoe.checkpoint.stream import CONVERSION_MAX_FILE_BYTES, CheckpointStreamWriter, StreamedTensor
from megamoe.hf.adapters import AdapterError, HFAdapter, adapter_for
from megamoe.hf.block_fp8_steps import HFWeightForm
from megamoe.hf.hf_quantization import (DequantizedByAdapter, hf_quantization, resolve_block_fp8,
                                        without_quantization)
from megamoe.hf.hf_sizes import check_layout_sizes, check_sizes_against_weights
from megamoe.hf.target_dtype import cast, target_dtype
from megamoe.models import GPTMoEConfig
from megamoe.models.families import SUPPORTED_FAMILIES, config_from_hf, declared_mtp_layers
from megamoe.moe.token_dispatcher import DEFAULT_DISPATCHER
from megamoe.quantization.block_fp8 import BlockFP8Config, is_block_fp8_weight

__all__ = ["import_hf", "hf_config_object", "model_config_from_hf", "mtp_layers_to_import", "hf_key_order",
           "plan_hf_conversion", "hf_weights_adapter"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _automatic_gc_paused():
    """No automatic garbage collection inside: transformers' model registry, loaded on first use, makes
    hundreds of thousands of objects, and the full collections they trigger cost about a third of its
    0.6 s (measured). It makes no reference cycles worth collecting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def hf_config_object(config: dict, where: str):
    """A transformers config object of a supported family from a config.json dict."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_FAMILIES:
        raise ConversionError(f"{where}: model_type {model_type!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_FAMILIES)}")
    hf_quantization(config, where)          # a method or field not read here: refused, naming it
    try:
        import transformers
    except ImportError:
        raise ConversionError("reading HuggingFace configs needs transformers: pip install transformers") from None
    with _automatic_gc_paused():
        config_class = transformers.CONFIG_MAPPING[model_type]
    _refuse_conflicting_aliases(config, getattr(config_class, "attribute_map", {}), where)
    try:
        return config_class.from_dict(without_quantization(config))
    except Exception as e:  # noqa: BLE001 - transformers validates configs with several exception types
        raise ConversionError(f"{where}: transformers rejects the config: {e}") from None


def _refuse_conflicting_aliases(config: dict, aliases: dict, where: str) -> None:
    """transformers reads one of two names of a field (``num_experts`` / ``num_local_experts``, a top-level
    ``rope_theta`` / the one in ``rope_parameters``) and silently drops the other: two different values
    are refused, naming both."""
    pairs = [(alias, canonical, config[alias], config[canonical]) for alias, canonical in aliases.items()
             if alias in config and canonical in config]
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" in config:
        pairs.append(("rope_theta", "rope_parameters.rope_theta", config["rope_theta"], rope["rope_theta"]))
    for first, second, a, b in pairs:
        if a != b:          # NaN included: it equals nothing
            raise ConversionError(f"{where}: {first} is {a!r} but {second} is {b!r}; transformers reads only one of "
                                  "them: keep one, or give both the same value")


# config.json sizes and counts for which 0 or less means nothing (several divide by them). Checked before
# transformers or the model see them, so that the error names the field.
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "moe_intermediate_size", "num_experts_per_tok", "num_local_experts",
                    "num_experts", "n_routed_experts", "n_group", "topk_group", "max_position_embeddings",
                    "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def _check_sizes(config: dict, where: str) -> None:
    for name in _POSITIVE_FIELDS:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConversionError(f"{where}: {name} must be a positive integer, got {value!r}; fix config.json")


def mtp_layers_to_import(config: dict, hf_keys, where: str) -> int:
    """The MTP layers an import of these HF tensors builds: those config.json declares
    (:func:`declared_mtp_layers`), or 0 when the checkpoint holds no ``model.layers.{L}.*`` tensor at all
    (L = num_hidden_layers): transformers writes ``num_nextn_predict_layers`` (default 1) into every
    DeepSeek-V3 config.json but saves no MTP weights. A checkpoint holding some of them must hold them all
    (the adapter names what is missing)."""
    try:
        declared = declared_mtp_layers(config)
    except ValueError as e:
        raise ConversionError(f"{where}: {e}") from None
    if not declared:
        return 0
    prefix = f"model.layers.{config.get('num_hidden_layers')}."
    if not any(key.startswith(prefix) for key in hf_keys):
        logger.info("%s declares %d MTP layer(s) but the checkpoint holds no %s* tensors: importing without them",
                    where, declared, prefix)
        return 0
    return declared


def model_config_from_hf(config: dict, where: str, *, hf_keys=None, **engine) -> GPTMoEConfig:
    """The model config of a config.json dict. ``hf_keys``: the checkpoint's tensor names, which decide
    whether its declared MTP layers are built (:func:`mtp_layers_to_import`); None (a config.json alone):
    none, as transformers declares one in every DeepSeek-V3 config.json it writes. ``engine``:
    :func:`config_from_hf`'s keywords (an explicit ``mtp_num_layers`` overrides both)."""
    _check_sizes(config, where)
    if "mtp_num_layers" not in engine:
        engine["mtp_num_layers"] = 0 if hf_keys is None else mtp_layers_to_import(config, hf_keys, where)
    try:
        return config_from_hf(hf_config_object(config, where), **engine)
    except ValueError as e:
        if isinstance(e, ConversionError):
            raise
        raise ConversionError(f"{where}: {e}") from None
    except ArithmeticError as e:        # a size combination no check above caught: still one line, not a traceback
        raise ConversionError(f"{where}: the config's sizes are inconsistent ({type(e).__name__}: {e})") from None


def hf_key_order(adapter: HFAdapter, config: GPTMoEConfig, keys) -> list[str]:
    """``keys`` in the adapter's step order (each step's inputs together), unknown keys last."""
    order: dict[str, int] = {}
    index = 0
    for fused in (False, True):
        for step in adapter.transforms(config, fused):
            for key in step.hf_keys:
                order.setdefault(key, index)
            index += 1
    return sorted(keys, key=lambda k: (order.get(k, index), k))


def hf_weights_adapter(hf: HFCheckpoint, adapter: HFAdapter, config: GPTMoEConfig,
                       dequantize_to: torch.dtype | None) -> tuple[HFAdapter, GPTMoEConfig]:
    """The adapter reading ``hf``'s weight files and the model config they give, for the unquantized model
    config ``config`` that ``hf``'s config.json maps to. A block-FP8 checkpoint (checked against its
    files: :func:`~megamoe.hf.hf_quantization.resolve_block_fp8`) is kept so
    (``dequantize_to=None``: the config gets its ``weight_quantization``) or dequantized into
    ``dequantize_to``; any other checkpoint gives ``adapter`` and ``config`` back."""
    where = os.path.join(hf.directory, "config.json")
    quantization = hf_quantization(hf.config, where)
    if quantization is None:
        for key, info in hf.tensors.items():
            if info.dtype.itemsize == 1 and info.dtype.is_floating_point and not adapter.is_ignored(key, config):
                raise ConversionError(f"{where}: {key!r} is {info.dtype}, but config.json has no quantization_config "
                                      "saying how its values are scaled (a block-FP8 release has quant_method 'fp8' "
                                      "and weight_block_size)")
        return adapter, config
    if isinstance(quantization, DequantizedByAdapter):    # the adapter's import-only steps read the files
        return adapter, config
    if not isinstance(quantization, BlockFP8Config):      # a method of QUANTIZATION_METHODS without a reader here
        raise ConversionError(f"{where}: internal: no weight reader for quantization_config "
                              f"{hf.config['quantization_config'].get('quant_method')!r}")
    quantizable = {key: name for name, key in adapter.renames(config).items() if is_block_fp8_weight(name)}
    resolved = resolve_block_fp8(quantization, hf.config["quantization_config"], hf.tensors, quantizable,
                                 lambda key: adapter.is_ignored(key, config), where)
    if dequantize_to is None:
        experts = sorted(n for n in resolved.unquantized if ".mlp.experts." in n)
        if experts:         # the model stacks a layer's experts: all of them are kept FP8, or none is
            raise ConversionError(f"{where}: quantization_config leaves routed experts unquantized ({experts[0]}, "
                                  f"{len(experts)} weights); kept FP8 needs every routed expert quantized: import "
                                  "with --dtype bf16 (dequantized)")
        return adapter, dataclasses.replace(config, weight_quantization=resolved)
    return adapter.with_hf_weights(HFWeightForm(resolved, dequantize_to)), config


def _as_conversion_error(e: AdapterError, where: str) -> ConversionError:
    return ConversionError(f"{where}: the weights do not match config.json: {e}")


def plan_hf_conversion(hf: HFCheckpoint, adapter: HFAdapter,
                       config: GPTMoEConfig) -> tuple[list[str], list[tuple[str, torch.dtype, tuple]], list[str]]:
    """Dry run on meta tensors: every check on the HF keys, dtypes and shapes, nothing read. Returns the
    HF keys in reading order, the logical ``(name, dtype, shape)`` they give in that order, and the HF
    keys the model does not use (dropped, as transformers drops them)."""
    quantization = hf_quantization(hf.config, os.path.join(hf.directory, "config.json"))
    packed_suffixes = quantization.packed_suffixes if isinstance(quantization, DequantizedByAdapter) else ()
    for key, info in hf.tensors.items():
        packed = packed_suffixes and key.endswith(packed_suffixes)      # e.g. uint8 MXFP4 bytes
        if not info.dtype.is_floating_point and not packed:
            raise ConversionError(f"dtype mismatch: {key!r} in {info.file} is {info.dtype}; model weights are "
                                  "floating point")
    dropped = [k for k in hf.tensors if adapter.is_ignored(k, config)]
    order = hf_key_order(adapter, config, [k for k in hf.tensors if not adapter.is_ignored(k, config)])
    meta = ((k, torch.empty(hf.tensors[k].shape, dtype=hf.tensors[k].dtype, device="meta")) for k in order)
    try:
        produced = [(name, t.dtype, tuple(t.shape)) for name, t in adapter.iter_hf_to_megamoe(meta, config)]
    except AdapterError as e:
        raise _as_conversion_error(e, hf.directory) from None
    return order, produced, dropped


def import_hf(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, layout: ParallelLayout, *,
              num_expert_slots: int | None = None, expert_load: str | os.PathLike | None = None,
              dtype: str = "keep", dispatcher: str = DEFAULT_DISPATCHER, overwrite: bool = False,
              max_file_bytes: int = CONVERSION_MAX_FILE_BYTES, progress: bool | None = None,
              allow_non_finite: bool = False) -> dict:
    """Convert the HF model directory ``hf_dir`` into the megamoe checkpoint ``out_dir`` for ``layout``.

    ``num_expert_slots`` (default: one per expert) and ``expert_load`` (a per-layer load file: balanced
    placements) choose the expert slots; ``dtype``: ``keep`` | ``fp32`` | ``bf16`` | ``fp16`` (floating
    tensors only); ``dispatcher`` is recorded in the model config. A weight holding NaN or Inf (each is
    scanned as it streams) is refused by name unless ``allow_non_finite`` (then a warning names it).
    Raises :class:`ConversionError` (nothing is left at ``out_dir``) for bad input. Returns a summary dict.
    """
    hf_dir = os.fspath(hf_dir)
    target = target_dtype(dtype)
    output = OutputDirectory(out_dir, overwrite=overwrite, what="a megamoe checkpoint", inputs=[hf_dir],
                             replaceable=lambda p: os.path.isfile(os.path.join(p, MANIFEST_FILE)))
    hf = HFCheckpoint.open(hf_dir)
    hf_config = dict(hf.config)
    quantization = hf_quantization(hf_config, os.path.join(hf_dir, "config.json"))
    if isinstance(quantization, DequantizedByAdapter):
        if any(key.endswith(quantization.packed_suffixes) for key in hf.tensors) and target not in (torch.float32,
                                                                                                    torch.bfloat16):
            raise ConversionError(f"{hf_dir}: the checkpoint holds {quantization.method.upper()} weights, which "
                                  f"import dequantizes: choose --dtype bf16 or fp32 (got {dtype!r})")
        del hf_config["quantization_config"]        # the imported weights are no longer quantized
    config = model_config_from_hf(hf.config, os.path.join(hf_dir, "config.json"), dispatcher=dispatcher,
                                  num_expert_slots=num_expert_slots, hf_keys=hf.tensors)
    if num_expert_slots is not None and config.moe is None:
        raise ConversionError("--num-expert-slots was given but the model has no MoE layers")
    # Every size is checked before anything is built from it: config.json against the weight files (the
    # dry run checks every shape, on meta tensors), the layout against the heads and this machine's memory.
    check_sizes_against_weights(config, hf.config, hf.tensors, os.path.join(hf_dir, "config.json"))
    check_layout_sizes(config, layout)
    adapter, config = hf_weights_adapter(hf, adapter_for(config.family), config, target)
    order, produced, dropped = plan_hf_conversion(hf, adapter, config)
    placements = build_placements(config, layout.ep, expert_load=expert_load)
    plan = plan_layout(config, layout, placements)
    names = {name for name, _, _ in produced}
    if names != set(plan.tensors):
        raise ConversionError(f"internal: the {config.family} adapter and the model disagree on the logical tensors: "
                              f"{sorted(names ^ set(plan.tensors))[:6]}")
    if dropped:
        logger.warning("dropping %d HF tensors the model does not use (as transformers does): %s%s", len(dropped),
                       ", ".join(dropped[:4]), " ..." if len(dropped) > 4 else "")
    streamed = [StreamedTensor(name, cast(dt, target), shape, plan.tensors[name].regions)
                for name, dt, shape in produced]
    # Logical tensors that are an HF tensor under another name: their bytes lie in the HF file as they are.
    # Those whose chunks are all runs of those bytes are only scanned (a meta placeholder goes through the
    # adapter), the others are copied through memory only for their chunks cut along a later dimension.
    renamed_from = adapter.renames(config)
    placeholders = {renamed_from[t.name] for t in streamed
                    if renamed_from.get(t.name) in hf.tensors and hf.tensors[renamed_from[t.name]].dtype == t.dtype
                    and t.chunks_are_runs}

    finite = NonFiniteCheck(hf_dir, allow=allow_non_finite)
    with output as tmp:
        writer = CheckpointStreamWriter(tmp, streamed, max_file_bytes=max_file_bytes)
        casts = ScratchBuffer()
        try:
            with ReadWindow() as window, tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="import-hf",
                                              disable=None if progress is None else not progress) as bar:
                latest: dict[str, torch.Tensor] = {}        # the HF tensor read last (a rename's input)

                def items():
                    for key, tensor in hf.iter_tensors(order, window, placeholders, scan=finite):
                        latest.clear()
                        latest[key] = tensor
                        yield key, tensor
                for name, tensor in adapter.iter_hf_to_megamoe(items(), config):
                    # The adapter's outputs view the mapped HF files or are its own new tensors: either way
                    # their memory stays as it is (stable), unlike the reused buffer of a cast.
                    source, stable = None, True
                    if cast(tensor.dtype, target) != tensor.dtype:
                        tensor, stable = casts.copy_of(tensor, target), False
                    elif latest.get(renamed_from.get(name)) is tensor and tensor.is_contiguous():
                        source = hf.extent(renamed_from[name])
                    writer.write(name, tensor, source, stable=stable)
                    bar.update(tensor.numel() * tensor.element_size())
            hf_files = copy_side_files(hf_dir, hf.side_files, os.path.join(tmp, HF_FILES_DIR))
            extra = {"step": 0, "sampler_state": None, "has_optimizer_state": False, "hf_config": hf_config,
                     "hf_files": hf_files}
            manifest = writer.finish(manifest_fields(config, layout, placements, extra), layout.world_size)
        except AdapterError as e:
            writer.abort()
            raise _as_conversion_error(e, hf_dir) from None
        except BaseException:
            writer.abort()
            raise
    summary = {"out_dir": output.path, "family": config.family, "layout": layout.to_manifest(),
               "logical_tensors": len(streamed), "files": len(manifest["files"]),
               "bytes": sum(f["bytes"] for f in manifest["files"].values()), "side_files": sorted(hf_files),
               "dropped_hf_tensors": dropped, "non_finite_tensors": finite.found,
               "block_fp8": "kept" if config.weight_quantization is not None else
               "dequantized" if adapter.hf_weights is not None else None}
    logger.info("imported %s into %s (%s)", hf_dir, output.path, layout)
    return summary
