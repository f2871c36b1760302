"""Shared by tests/unit/test_checkpoint_integrity.py and tests/multirank/test_checkpoint_integrity.py: the builders
and constants of the checkpoint integrity tests."""

import os
import shutil

import pytest

from megamoe.checkpoint import checksums
from parallel_state import ParallelState
from tests.helpers.hf_checkpoints import convert, save_hf_model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A tiny HF model, its import (one file) and a training checkpoint of it (model, optimizer, rank
    state and side files, one file), made once."""
    from tests.helpers.checkpointed_training import build_sampler, build_trainer, dataset, train_steps
    from megamoe.training.checkpoint import save_training_checkpoint

    root = tmp_path_factory.mktemp("sources")
    save_hf_model(root / "hf", "qwen3_moe")
    assert convert("import-hf", root / "hf", root / "imported", "--tp", 1, "--pp", 1, "--ep", 1) == 0
    state = ParallelState.single_process()
    trainer, sampler = build_trainer(state), build_sampler(state)
    train_steps(trainer, sampler, dataset(), 1)
    save_training_checkpoint(root / "trained", trainer, sampler_state=sampler.state_dict(), world_group=None)
    return root


def _copy(sources, name, tmp_path):
    target = tmp_path / name
    shutil.copytree(sources / name, target)
    return target


# ----------------------------------------------------------------------------------------------
# Hashed once per process, and once over ranks loading together
# ----------------------------------------------------------------------------------------------
def _counting_hashes(monkeypatch=None):
    """Patch the file hasher to count calls (per file); returns the counter."""
    counts = {}
    real = checksums._hash_file

    def counting(path, *args, **kwargs):
        counts[os.path.basename(path)] = counts.get(os.path.basename(path), 0) + 1
        return real(path, *args, **kwargs)
    if monkeypatch is not None:
        monkeypatch.setattr(checksums, "_hash_file", counting)
    else:
        checksums._hash_file = counting
    return counts
