"""A LoRA fine-tuning run: the ``--lora-*`` flags of ``megamoe train``, and what its checkpoints record.

``--lora-rank R`` turns LoRA on (:func:`megamoe.lora.apply_lora` right after the model is built and its base
weights loaded; the optimizer then holds the adapters only, the distributed one included, since both take the
parameters that require gradients). ``--lora-alpha`` (default ``2 * R``), ``--lora-dropout`` (routed experts'
adapter inputs only), ``--lora-targets`` (comma-separated names of :data:`megamoe.lora.LORA_TARGETS`).

Every checkpoint of a LoRA run holds the frozen base with the adapters (so it loads, generates and exports
like any checkpoint) and the optimizer state of the adapters only, plus the side file ``lora.json``: the
:class:`~megamoe.lora.LoRAConfig` and the base it started from (``--hf-model`` directory, or the seed of a
from-scratch base) with the base's fingerprint (:func:`base_fingerprint`). A run resuming a checkpoint checks
both: another LoRA config, another base, or a LoRA run resuming a checkpoint without adapters (or the
reverse) is a :class:`~megamoe.errors.UsageError`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from megamoe.errors import UsageError
from megamoe.hf.lora_checkpoint import LORA_FILE
from megamoe.lora import DEFAULT_LORA_TARGETS, LORA_TARGETS, LoRAConfig

__all__ = ["add_lora_arguments", "lora_config_from_args", "LORA_FILE", "lora_file", "check_lora_file",
           "base_fingerprint"]

_WEIGHT_SUFFIXES = (".safetensors", ".json")


def add_lora_arguments(parser) -> None:
    g = parser.add_argument_group("LoRA fine-tuning (a frozen base; only the adapters train)")
    g.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="train LoRA adapters of rank R on a frozen base (default: no LoRA, the whole model trains)")
    g.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                   help="LoRA alpha: the adapters are scaled by A / R (default 2 * R)")
    g.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                   help="dropout on the routed experts' adapter inputs (dense adapters are added to their "
                        "weights, which has none: needs --lora-targets without them)")
    g.add_argument("--lora-targets", default=",".join(DEFAULT_LORA_TARGETS), metavar="NAMES",
                   help=f"comma-separated weights to adapt, of {', '.join(LORA_TARGETS)}")


def lora_config_from_args(args) -> LoRAConfig | None:
    """The run's LoRAConfig (None without ``--lora-rank``); UsageError naming the flag for a bad value."""
    if args.lora_rank is None:
        return None
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    try:
        return LoRAConfig(rank=args.lora_rank, alpha=alpha, dropout=args.lora_dropout, targets=args.lora_targets)
    except ValueError as e:
        flag = {"rank": "--lora-rank", "alpha": "--lora-alpha", "dropout": "--lora-dropout",
                "targets": "--lora-targets"}[str(e).split(" ", 1)[0].split(".", 1)[1]]
        raise UsageError(f"{flag}: {e}") from None


def base_fingerprint(hf_dir: str | os.PathLike) -> str:
    """sha256 over the names, sizes and contents of ``hf_dir``'s weight files and config (``*.safetensors``,
    ``*.json``), read in 1 MiB blocks: what ``lora.json`` records of the base."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(hf_dir).iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _base_reference(args) -> dict:
    if args.hf_model is not None:
        return {"hf_model": os.fspath(Path(args.hf_model).resolve()), "sha256": base_fingerprint(args.hf_model)}
    return {"from_scratch_seed": args.seed}


def lora_file(config: LoRAConfig, args) -> bytes:
    """The bytes of ``lora.json`` for a run of ``config`` (the config and the base reference)."""
    return (json.dumps({"config": json.loads(config.to_json()), "base": _base_reference(args)}, indent=2,
                       sort_keys=True) + "\n").encode()


def check_lora_file(saved: bytes | None, config: LoRAConfig | None, args, checkpoint: str) -> None:
    """Refuse to resume ``checkpoint`` (its ``lora.json`` bytes ``saved``, None without) under another LoRA
    config or on another base (UsageError naming what differs and the fix)."""
    if config is None and saved is None:
        return
    if saved is None:
        raise UsageError(f"{checkpoint} holds no LoRA adapters ({LORA_FILE}): a LoRA run starts from --hf-model and "
                         "resumes its own checkpoints; drop --load-dir, or the --lora-* flags")
    try:
        record = json.loads(saved)
        saved_config = LoRAConfig.from_json(json.dumps(record["config"]), f"{checkpoint}/{LORA_FILE}")
        saved_base = record["base"]
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{checkpoint}/{LORA_FILE} is damaged: {e}") from None
    if config is None:
        raise UsageError(f"{checkpoint} is a LoRA run's checkpoint ({saved_config}): resume it with the same "
                         f"--lora-rank {saved_config.rank} --lora-alpha {saved_config.alpha:g} --lora-targets "
                         f"{','.join(saved_config.targets)}")
    if saved_config != config:
        raise UsageError(f"{checkpoint} was trained with {saved_config}, this run asks for {config}: use the same "
                         "--lora-* flags to resume it")
    if "sha256" in saved_base and args.hf_model is not None:
        now = base_fingerprint(args.hf_model)
        if now != saved_base["sha256"]:
            raise UsageError(f"--hf-model {args.hf_model} is not the base {checkpoint} was trained on (its "
                             f"{LORA_FILE} records {saved_base['hf_model']} with sha256 {saved_base['sha256'][:16]}..., "
                             f"this directory has {now[:16]}...): resume with the same base")
