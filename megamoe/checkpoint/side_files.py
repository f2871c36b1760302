"""HuggingFace side files (tokenizer, generation config, chat template, ...) carried through conversions.

An import copies every top-level file of the HF directory that is neither config.json nor weights into
``<checkpoint>/hf_files/`` and records each one's size and checksum in the manifest (``extra.hf_files``);
export copies them back next to the new config.json; reshard carries them along, after checking every
one against its record (nothing is copied when one is damaged). A side file's name is one plain file
name (checked when the manifest is read, and again here before anything is written).
"""

from __future__ import annotations

import os
import shutil

from megamoe.checkpoint import checksums
from megamoe.checkpoint.errors import CheckpointError
from megamoe.checkpoint.manifest import read_manifest, resolve_checkpoint
from megamoe.checkpoint.manifest_fields import HF_FILES_DIR
from megamoe.checkpoint.safe_names import check_name, check_regular_file

__all__ = ["copy_side_files", "verify_side_files", "read_side_file"]


def copy_side_files(source_dir: str, names: list[str], target_dir: str, *,
                    recorded: dict[str, dict] | None = None) -> dict[str, dict]:
    """Copy ``names`` from ``source_dir`` into ``target_dir`` (created); returns name -> checksum entry.
    With ``recorded`` (the manifest's entries) every source is first checked against its entry: a
    CheckpointError names the damaged or missing file and nothing is copied."""
    for name in names:
        check_name(name, f"side file of {source_dir}", single_component=True)
    if recorded is not None:
        problems = verify_side_files(source_dir, {name: recorded[name] for name in names})
        if problems:
            raise CheckpointError("; ".join(problems))
    os.makedirs(target_dir, exist_ok=True)
    copied = {}
    for name in sorted(names):
        target = os.path.join(target_dir, name)
        shutil.copyfile(check_regular_file(os.path.join(source_dir, name), "side file"), target)
        copied[name] = checksums.file_entry(target)
    return copied


def verify_side_files(directory: str, recorded: dict[str, dict]) -> list[str]:
    """Problems with the side files in ``directory`` against their record (empty when all match)."""
    problems = []
    for name, info in sorted(recorded.items()):
        path = os.path.join(directory, name)
        try:
            check_regular_file(path, "side file")
        except CheckpointError as e:
            problems.append(str(e))
            continue
        problem = checksums.check_entry(path, info)
        if problem is not None:
            problems.append(f"side file {problem}")
    return problems


def read_side_file(checkpoint: str, name: str) -> bytes | None:
    """The side file ``name`` of ``checkpoint`` (``hf_files/``), checked against its manifest record; None
    where the checkpoint records none of that name."""
    recorded = ((read_manifest(checkpoint).get("extra") or {}).get("hf_files") or {})
    if name not in recorded:
        return None
    directory = os.path.join(resolve_checkpoint(checkpoint), HF_FILES_DIR)
    problems = verify_side_files(directory, {name: recorded[name]})
    if problems:
        raise CheckpointError("; ".join(problems))
    with open(os.path.join(directory, name), "rb") as f:
        return f.read()
