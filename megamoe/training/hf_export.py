"""The end of a training run: its final checkpoint as a HuggingFace model directory (``--export-hf OUT``; a LoRA
run's merged), and a LoRA run's adapters as a PEFT adapter directory (``--export-peft OUT``).

A run exports with :func:`megamoe.hf.export_hf.export_hf`, which takes config.json and the side
files from the checkpoint's :class:`~megamoe.training.checkpoint.HFProvenance` (stored by every save the
run passes it to). Where the provenance comes from:

- a run started from an HF directory: that directory's config.json and side files
  (:class:`megamoe.training.hf_start.HFStart`);
- a run from scratch with an HF config.json as its model config: that file, and the run's tokenizer
  files as side files (:func:`tokenizer_side_files`);
- a run from scratch with megamoe config fields: a config.json written for its family
  (:mod:`megamoe.hf.hf_config_writer`), and the tokenizer files;
- a resumed run: the checkpoint it resumes (or the above, when that checkpoint has none).

A run that trains with another tokenizer than its HF directory's exports its own (:func:`with_tokenizer`).

A model of the demo's ``custom`` family, or one its family's config.json cannot express, cannot be
exported: :func:`provenance_for_export` says so when the run starts, not when it ends.
"""

from __future__ import annotations

import dataclasses
import os

from megamoe import comms
from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.format import CheckpointError, read_manifest
from megamoe.data.tokenizer import HFTokenizer, Tokenizer
from megamoe.hf.adapters import ADAPTERS
from megamoe.hf.export_hf import export_hf
from megamoe.hf.hf_config_writer import hf_config_for
from megamoe.hf.lora_checkpoint import lora_checkpoint
from megamoe.hf.peft_export import export_peft_checkpoint
from megamoe.models import GPTMoEConfig
from megamoe.training.checkpoint import HFProvenance

__all__ = ["provenance_for_export", "tokenizer_side_files", "with_tokenizer", "export_final_checkpoint"]

# What transformers' AutoTokenizer reads beside tokenizer.json (tokenizer.json itself names no special tokens;
# chat_template.jinja is the chat template, which chat data is rendered with).
_HF_TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def provenance_for_export(config: GPTMoEConfig, provenance: HFProvenance | None, where: str) -> HFProvenance:
    """The provenance a run of ``config`` exports with: ``provenance``, or for a model that has none (megamoe
    config fields) a config.json written for its family (:func:`~megamoe.hf.hf_config_writer.hf_config_for`).
    ValueError naming ``where`` (e.g. the flag that chose the model), before any training, when the run
    will not be able to write an HF directory at its end."""
    if config.family not in ADAPTERS:
        raise ConversionError(f"{where}: a model of family {config.family!r} has no HuggingFace equivalent and "
                              f"cannot be exported (exportable families: {', '.join(ADAPTERS)}); drop --export-hf")
    if provenance is not None:
        return provenance
    return HFProvenance(hf_config_for(config, where), {})


def tokenizer_side_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """The files an HF directory needs for ``tokenizer``: ``tokenizer.json`` and its companions
    (tokenizer_config.json, special_tokens_map.json, chat_template.jinja, when beside it), or a sentencepiece
    ``tokenizer.model``."""
    if isinstance(tokenizer, HFTokenizer):
        files = {"tokenizer.json": tokenizer.path.read_bytes()}
        for name in _HF_TOKENIZER_COMPANIONS:
            companion = tokenizer.path.parent / name
            if companion.is_file():
                files[name] = companion.read_bytes()
        return files
    return {"tokenizer.model": tokenizer.path.read_bytes()}


def with_tokenizer(provenance: HFProvenance, tokenizer: Tokenizer) -> HFProvenance:
    """``provenance`` whose tokenizer files are ``tokenizer``'s (a run that trains with another tokenizer
    than its HF directory's exports the one it trained with)."""
    kept = {name: data for name, data in provenance.files.items()
            if name not in ("tokenizer.json", "tokenizer.model", *_HF_TOKENIZER_COMPANIONS)}
    return dataclasses.replace(provenance, files={**kept, **tokenizer_side_files(tokenizer)})


def export_final_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, world_group,
                            verify_checksums: bool = True, peft: bool = False) -> dict:
    """Write the HF directory ``out_dir`` from the training checkpoint ``checkpoint`` (saved with an
    HFProvenance): a LoRA run's with its adapters merged; with ``peft``, the LoRA run's adapters as a PEFT
    adapter directory instead. Collective over ``world_group`` (None: one process): rank 0 writes, every rank
    returns its summary or raises its error (nothing is left at ``out_dir`` then)."""
    rank = comms.group_rank(world_group)
    summary, error = None, None
    if rank == 0:
        try:
            if peft:
                summary = export_peft_checkpoint(checkpoint, out_dir, verify_checksums=verify_checksums)
            else:
                lora = lora_checkpoint(os.fspath(checkpoint), read_manifest(checkpoint))
                summary = export_hf(checkpoint, out_dir, verify_checksums=verify_checksums,
                                    merge_lora=lora is not None)
        except (ValueError, CheckpointError, OSError) as e:
            error = f"{'--export-peft' if peft else '--export-hf'} {out_dir}: {e}"
    summary, error = comms.all_gather_object((summary, error), world_group)[0]
    if error is not None:
        raise ConversionError(error)
    return summary
