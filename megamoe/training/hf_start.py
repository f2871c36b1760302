"""Start a training run from a HuggingFace model directory, in process: ``import-hf`` without the disk.

:func:`start_from_hf` builds this rank's stage of the model for the run's layout and fills it from the
HF safetensors, with the expert slots and placements ``import-hf`` would choose (``num_expert_slots``,
an expert-load file: :func:`megamoe.checkpoint.placements.build_placements`). Nothing is written.

Reading. Each rank streams the HF files itself (:meth:`HFCheckpoint.iter_tensors`: views of the mapped
files, at most a window of them mapped at a time) and reads only the HF tensors that feed a logical tensor
it holds: the others go through the family's adapter as meta placeholders, so its checks (every key
known, none missing, every shape right) still cover the whole checkpoint, on every rank alike. A tensor
the rank holds a slice of (TP, an expert in some of its slots) is copied slice by slice into its chunks.

The config is the training one (:func:`~megamoe.models.families.config_from_hf`, ``for_training=True``:
the family's load balancing on). The run keeps the HF ``config.json`` and side files (tokenizer,
generation config, ...) as :class:`~megamoe.training.checkpoint.HFProvenance`, to pass to every
:func:`~megamoe.training.checkpoint.save_training_checkpoint`: its checkpoints then export to HF with the
original config's fields.

Vocabulary and TP. The embedding and the output layer are split over TP by rows; a ``vocab_size`` the
TP size does not divide (added tokens: 32001, 151669, ...) is padded inside the model
(:mod:`megamoe.tensor_parallel.vocab_padding`): the padding rows are outside the logical tensors, so the
checkpoints keep the HF shape and export back to it, and their logits are masked out of the loss and
of generation.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.finite_values import NonFiniteCheck
from megamoe.checkpoint.hf_checkpoint import CONFIG_FILE, HFCheckpoint
from megamoe.checkpoint.placements import build_placements
from megamoe.checkpoint.read_window import ReadWindow
from megamoe.hf.adapters import AdapterError, adapter_for
from megamoe.hf.hf_sizes import check_sizes_against_weights
from megamoe.hf.import_hf import hf_weights_adapter, model_config_from_hf, plan_hf_conversion
from megamoe.models import GPTMoEConfig, GPTMoEModel, LayerSpec
from megamoe.models.hf_loading import chunks_by_name, copy_into_chunks
from megamoe.moe.token_dispatcher import DEFAULT_DISPATCHER
from megamoe.training.checkpoint import HFProvenance

__all__ = ["HFStart", "hf_start_config", "load_hf_weights", "start_from_hf"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HFStart:
    """What a run started from the HF directory ``hf_dir`` builds its model with (``config``, the
    training config with the run's engine choices) and remembers (``provenance``: config.json and the
    side files, for its checkpoints)."""

    hf_dir: str
    config: GPTMoEConfig
    provenance: HFProvenance


def hf_start_config(hf_dir: str | os.PathLike, *, dispatcher: str = DEFAULT_DISPATCHER, num_expert_slots: int | None = None,
                    expert_backend: str = "auto") -> HFStart:
    """The model config and provenance of the HF directory ``hf_dir``; reads config.json, the weight
    files' headers and the side files, no tensor data. Raises :class:`ConversionError` naming the file and
    field for a directory or config that cannot be used."""
    hf = HFCheckpoint.open(hf_dir)
    return _start_of(hf, dispatcher=dispatcher, num_expert_slots=num_expert_slots, expert_backend=expert_backend)


def _start_of(hf: HFCheckpoint, **engine) -> HFStart:
    where = os.path.join(hf.directory, CONFIG_FILE)
    config = model_config_from_hf(hf.config, where, hf_keys=hf.tensors, **engine)
    check_sizes_against_weights(config, hf.config, hf.tensors, where)    # before a model is built of them
    if engine.get("num_expert_slots") is not None and config.moe is None:
        raise ConversionError(f"{hf.directory}: num_expert_slots was given but the model has no MoE layers")
    files = {}
    for name in hf.side_files:
        with open(os.path.join(hf.directory, name), "rb") as f:
            files[name] = f.read()
    return HFStart(hf.directory, config, HFProvenance(dict(hf.config), files))


def load_hf_weights(model: GPTMoEModel, hf: HFCheckpoint, *, progress: bool | None = None,
                    allow_non_finite: bool = False) -> int:
    """Fill ``model`` (this rank's stage and shards, of the config ``hf`` maps to) from the HF
    checkpoint ``hf``, reading only the HF tensors it holds part of; returns the bytes read.
    Raises :class:`ConversionError` when the weights do not match config.json (before reading any), and
    for a tensor read holding NaN or Inf unless ``allow_non_finite`` (then a warning names it)."""
    config = model.config
    # A block-FP8 release starts a run dequantized (fp32, then the parameters' dtype), unless the model
    # keeps its weights quantized itself.
    adapter, _ = hf_weights_adapter(hf, adapter_for(config.family), config,
                                    None if config.weight_quantization is not None else torch.float32)
    order, _, dropped = plan_hf_conversion(hf, adapter, config)
    held = chunks_by_name(model)
    # An HF key is read when one of the logical tensors of its step (a rename, or a fused expert
    # tensor split in several) is held here; either HF form may be on disk.
    outputs_of: dict[str, tuple[str, ...]] = {}
    for fused in (False, True):
        for step in adapter.transforms(config, fused):
            for key in step.hf_keys:
                outputs_of[key] = step.logical_keys
    placeholders = {key for key in order if not any(name in held for name in outputs_of[key])}
    to_read = sum(hf.tensors[k].nbytes for k in order if k not in placeholders)
    if dropped:
        logger.info("%s: %d HF tensors the model does not use are skipped (as transformers skips them)",
                    hf.directory, len(dropped))
    filled = set()
    try:
        with ReadWindow() as window, tqdm(total=to_read, unit="B", unit_scale=True, desc="loading HF weights",
                                          disable=None if progress is None else not progress) as bar:
            finite = NonFiniteCheck(hf.directory, allow=allow_non_finite, doing="load")
            for name, logical in adapter.iter_hf_to_megamoe(_counted(hf, order, window, placeholders, bar, finite),
                                                            config):
                if name in held:
                    copy_into_chunks(name, held[name], logical)
                    filled.add(name)
    except AdapterError as e:
        raise ConversionError(f"{hf.directory}: the weights do not match config.json: {e}") from None
    unfilled = sorted(set(held) - filled)
    if unfilled:                    # the adapter and the model disagree: a bug, not a user error
        raise AssertionError(f"internal: the {config.family} adapter gave none of {unfilled[:6]}")
    return to_read


def _counted(hf: HFCheckpoint, order, window, placeholders, bar, finite: NonFiniteCheck):
    for key, tensor in hf.iter_tensors(order, window, placeholders):
        if key not in placeholders:         # each rank scans what it reads: every tensor is some rank's
            bar.update(hf.tensors[key].nbytes)
            finite(key, tensor)
        yield key, tensor


def start_from_hf(hf_dir: str | os.PathLike, state, *, dispatcher: str = DEFAULT_DISPATCHER,
                  num_expert_slots: int | None = None, expert_load: str | os.PathLike | None = None,
                  expert_backend: str = "auto", device=None, dtype=None, layer_spec: LayerSpec | None = None,
                  load_weights: bool = True, saved_placements: dict | None = None,
                  progress: bool | None = None, recompute: RecomputeConfig | None = None,
                  sequence_parallel: bool = False, virtual_pipeline_stages: int = 1,
                  make_vocab_size_divisible_by: int = 1,
                  allow_non_finite: bool = False) -> tuple[GPTMoEModel, HFStart]:
    """This rank's stage of the HF model in ``hf_dir`` under ``state`` (a ParallelState), filled from its
    safetensors, and the :class:`HFStart` the run keeps (pass ``start.provenance`` to every save).

    ``num_expert_slots`` (default: one per expert) and ``expert_load`` (a per-layer load file: balanced
    placements) choose the expert slots as ``import-hf`` does; ``dispatcher`` and ``expert_backend`` are
    the engine's, and so are ``recompute`` (activation recomputation; default: none) and
    ``sequence_parallel`` (``GPTMoEConfig.sequence_parallel``), ``make_vocab_size_divisible_by`` (the
    vocabulary padding, ``GPTMoEConfig.make_vocab_size_divisible_by``) and ``virtual_pipeline_stages`` (model
    chunks per pipeline rank, for the interleaved schedule).
    ``load_weights=False`` builds the model only (a run resuming from a checkpoint, which
    overwrites every weight); such a run passes the checkpoint's ``saved_placements`` ({layer id:
    ExpertPlacement}, e.g. reached by online rebalancing), kept where the slots and the EP size match
    (:func:`megamoe.checkpoint.placements.build_placements`). Every rank must call it (no collective is used:
    each reads its own part).
    Raises :class:`ConversionError` (a ValueError) for a directory, config, weights, slot count or
    expert-load file that cannot be used, and for weights holding NaN or Inf unless ``allow_non_finite``
    (each rank scans the tensors it reads: :func:`load_hf_weights`).
    """
    hf = HFCheckpoint.open(hf_dir)
    start = _start_of(hf, dispatcher=dispatcher, num_expert_slots=num_expert_slots, expert_backend=expert_backend)
    placements = build_placements(start.config, state.ep.size, expert_load=expert_load, saved=saved_placements)
    config = dataclasses.replace(start.config, sequence_parallel=sequence_parallel,
                                 make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    if recompute is not None:
        config = dataclasses.replace(config, recompute=recompute)
    model = GPTMoEModel(config, state, placements=placements, device=device, dtype=dtype, layer_spec=layer_spec,
                        virtual_pipeline_stages=virtual_pipeline_stages)
    if load_weights:
        read = load_hf_weights(model, hf, progress=progress, allow_non_finite=allow_non_finite)
        logger.info("loaded %s (%s) into this rank's part of the model: read %d of its %d bytes", hf.directory,
                    start.config.family, read, hf.total_bytes)
    return model, start
