"""Build this rank's :class:`GPTMoEModel` from a megamoe checkpoint (converted or trained) and fill it.

The model config comes from the manifest; the engine's choices (dispatcher, number of expert slots) may
differ from the saved ones. The saved expert placement of a layer is reused when its slots and EP size
match the model's, else the default placement is built: the checkpoint stores each expert once, so any
placement loads. Every rank reads only its own slices (no communication).
"""

from __future__ import annotations

import dataclasses
import os

from checkpoint_tools.format import load_checkpoint, read_manifest
from checkpoint_tools.manifest_fields import model_config_from_manifest, placements_from_manifest
from checkpoint_tools.placements import build_placements
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.models import GPTMoEConfig, GPTMoEModel

__all__ = ["config_for_engine", "build_model_from_checkpoint"]


def config_for_engine(config: GPTMoEConfig, *, dispatcher: str | None = None,
                      num_expert_slots: int | None = None) -> GPTMoEConfig:
    """``config`` with the engine choices replaced where given (None keeps the saved one)."""
    if config.moe is None or (dispatcher is None and num_expert_slots is None):
        return config
    moe = dataclasses.replace(config.moe, dispatcher=dispatcher or config.moe.dispatcher,
                              num_expert_slots=num_expert_slots or config.moe.num_expert_slots)
    return dataclasses.replace(config, moe=moe)


def build_model_from_checkpoint(path: str | os.PathLike, state, *, dispatcher: str | None = None,
                                num_expert_slots: int | None = None, dtype=None,
                                verify_checksums: bool = False) -> GPTMoEModel:
    """This rank's stage of the checkpoint's model under ``state`` (a ParallelState), weights loaded.

    Raises :class:`~checkpoint_tools.format.CheckpointError` if the checkpoint lacks a tensor or holds
    one of another shape, ValueError if the layout does not fit the model.
    """
    manifest = read_manifest(path)
    config = config_for_engine(model_config_from_manifest(manifest), dispatcher=dispatcher,
                               num_expert_slots=num_expert_slots)
    placements = build_placements(config, state.ep.size, saved=placements_from_manifest(manifest))
    model = GPTMoEModel(config, state, placements=placements, dtype=dtype)
    load_checkpoint(path, sharded_state_dict(model), verify_checksums=verify_checksums)
    return model
