"""A training run's config as a TOML file: the sections every field of ``megamoe train`` belongs to, the
file's text (what ``--print-config`` prints, what every checkpoint and the run directory keep as
``run_config.toml``), and the fields two configs differ in (what a resumed run logs).

Each field is the flag's destination (``--global-batch`` is ``schedule.global_batch``; the one opt-out flag,
``--no-verify-checksums``, is ``checkpoint.verify_checksums = false``). The sections mirror the config
dataclasses: ``model`` (GPTMoEConfig and the model's source), ``moe`` (MoEConfig, the placement and EPLB),
``parallel`` (ParallelState and the devices), ``data``, ``optimizer`` (TrainConfig's AdamW, precision and
optimizer memory), ``schedule`` (steps, batches, the LR schedule, evaluation), ``checkpoint``, ``lora`` (LoRA fine-tuning) and
``logging``.
"""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path

__all__ = ["SECTIONS", "SECTION_OF_FIELD", "RUN_CONFIG_FILE", "render_run_config", "read_run_config",
           "run_config_differences"]

RUN_CONFIG_FILE = "run_config.toml"

SECTIONS = {
    "model": ("hidden", "layers", "mtp_layers", "vocab_size", "hf_model", "model_config", "tokenizer",
              "allow_non_finite", "mtp_loss_coeff", "recompute", "recompute_modules"),
    "moe": ("experts", "top_k", "dispatcher", "expert_backend", "num_expert_slots", "moe_shared_expert_overlap",
            "expert_load", "eplb_interval", "eplb_window", "eplb_threshold", "eplb_max_layers"),
    "parallel": ("tp", "pp", "virtual_pipeline_stages", "ep", "etp", "cp", "sequence_parallel",
                 "make_vocab_size_divisible_by", "device", "comm_timeout"),
    "data": ("data", "data_weights", "text_field", "eval_data", "eval_fraction", "corpus_bytes", "seq_len",
             "reset_position_ids", "reset_attention_mask", "eod_mask_loss", "sft_overlong"),
    "optimizer": ("lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "autocast",
                  "param_dtype", "distributed_optimizer", "zero_stage", "overlap_grad_reduce", "grad_bucket_mb",
                  "max_skipped_steps", "initial_loss_scale", "loss_scale_window", "min_loss_scale"),
    "schedule": ("steps", "global_batch", "micro_batch", "seed", "lr_schedule", "warmup_steps", "lr_decay_steps",
                 "min_lr_ratio", "lr_wsd_decay_style", "lr_wsd_decay_steps", "lr_wsd_decay_fraction",
                 "override_opt_param_scheduler", "eval_every", "eval_iters"),
    "checkpoint": ("work_dir", "save_dir", "save_every", "keep_checkpoints", "load_dir", "load_step", "overwrite",
                   "allow_foreign_checkpoint", "verify_checksums", "export_hf", "export_peft"),
    "lora": ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"),
    "logging": ("log_json", "tensorboard_dir", "wandb_project", "wandb_run_name", "peak_tflops", "progress",
                "sample_tokens", "sample_prompt"),
}
SECTION_OF_FIELD = {field: section for section, fields in SECTIONS.items() for field in fields}
assert len(SECTION_OF_FIELD) == sum(map(len, SECTIONS.values())), "a field in two sections"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def render_run_config(values) -> str:
    """The TOML text of ``values`` (a namespace or dict holding the fields of :data:`SECTIONS`): one table per
    section, every field; a field that is not set (None, which TOML cannot write, or an empty list, which
    ``--config`` refuses as a key to leave out) as a comment."""
    values = values if isinstance(values, dict) else vars(values)
    lines = ["# megamoe train: the effective run config (megamoe train --config FILE reads it back)"]
    for section, fields in SECTIONS.items():
        lines.append(f"\n[{section}]")
        for field in fields:
            value = values.get(field)
            unset = value is None or (isinstance(value, (list, tuple)) and not value)
            lines.append(f"# {field}: not set" if unset else f"{field} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def read_run_config(text: str) -> dict[str, dict]:
    """The sections of a run config's TOML text (``tomllib.TOMLDecodeError`` if it is not TOML)."""
    return tomllib.loads(text)


def _comparable(value):
    return os.fspath(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value


def run_config_differences(saved: dict[str, dict], current: dict[str, dict]) -> list[str]:
    """``section.field saved -> current`` for each field the two configs (:func:`read_run_config`) set
    differently (a field one of them leaves unset included)."""
    names = sorted({(s, f) for config in (saved, current) for s, table in config.items()
                    if isinstance(table, dict) for f in table})
    differences = []
    for section, field in names:
        before = _comparable(saved.get(section, {}).get(field))
        after = _comparable(current.get(section, {}).get(field))
        if before != after:
            differences.append(f"{section}.{field} {before!r} -> {after!r}")
    return differences
