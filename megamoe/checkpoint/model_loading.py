"""Build this rank's :class:`GPTMoEModel` from a megamoe checkpoint (converted or trained) and fill it.

The model config comes from the manifest; the engine's choices (dispatcher, number of expert slots, expert
backend, sharded MoE input) may differ from the saved ones. The saved expert placement of a layer is
reused when its slots and EP size match the model's, else the default placement is built: the
checkpoint stores each expert once, so any placement loads. Every rank reads only its own slices; the
files are checked against the manifest first (checksums included unless ``verify_checksums=False``), by
one rank per file when the ranks pass ``world_group`` (see :mod:`megamoe.checkpoint.integrity`).
"""

from __future__ import annotations

import dataclasses
import os

from megamoe import comms
from megamoe.checkpoint.errors import CheckpointError
from megamoe.checkpoint.finite_values import NonFiniteCheck
from megamoe.checkpoint.format import load_checkpoint, read_manifest
from megamoe.checkpoint.manifest_fields import placements_from_manifest
from megamoe.checkpoint.model_manifest import check_model_manifest
from megamoe.checkpoint.placements import build_placements
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.models import GPTMoEConfig, GPTMoEModel, LayerSpec

__all__ = ["config_for_engine", "build_model_from_checkpoint"]


def config_for_engine(config: GPTMoEConfig, *, dispatcher: str | None = None,
                      num_expert_slots: int | None = None, expert_backend: str | None = None,
                      input_sharded: bool | None = None, sequence_parallel: bool | None = None) -> GPTMoEConfig:
    """``config`` with the engine choices of its MoE layers replaced where given (None keeps the saved
    one): how tokens reach the experts, how many slots hold them and which GEMM backend runs them; and
    ``sequence_parallel`` (generation passes False: a run trained with it decodes without it)."""
    if sequence_parallel is not None:
        config = dataclasses.replace(config, sequence_parallel=sequence_parallel)
    engine = {"dispatcher": dispatcher, "num_expert_slots": num_expert_slots, "expert_backend": expert_backend,
              "input_sharded": input_sharded}
    engine = {name: value for name, value in engine.items() if value is not None}
    if config.moe is None or not engine:
        return config
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, **engine))


def build_model_from_checkpoint(path: str | os.PathLike, state, *, dispatcher: str | None = None,
                                num_expert_slots: int | None = None, expert_backend: str | None = None,
                                input_sharded: bool | None = None, sequence_parallel: bool | None = None,
                                device=None, dtype=None,
                                verify_checksums: bool = True, world_group=None,
                                layer_spec: LayerSpec | None = None, allow_non_finite: bool = False) -> GPTMoEModel:
    """This rank's stage of the checkpoint's model under ``state`` (a ParallelState), weights loaded
    onto ``device`` in ``dtype``; the engine choices as in :func:`config_for_engine`.

    ``verify_checksums``: hash every file read before using it (``False``: sizes only).
    ``world_group``: the process group of every rank building the model together (a ParallelState holds
    no group spanning all its ranks, so it is passed explicitly, e.g. ``torch.distributed.group.WORLD``);
    with it each file is hashed by one rank only, and a damaged file fails every rank alike. Without it
    each rank hashes the files it reads. ``layer_spec``: the classes the model was built with
    (:class:`~megamoe.models.LayerSpec`; a checkpoint does not record them).

    Every weight loaded is scanned for NaN and Inf (a checkpoint saved with verification off may hold
    them): refused, naming the first, unless ``allow_non_finite`` (then a warning names each); with
    ``world_group`` every rank refuses alike.

    Raises :class:`~megamoe.checkpoint.format.CheckpointError` if the checkpoint lacks a tensor, holds
    one of another shape, a damaged file or a non-finite weight; ValueError if the layout does not fit
    the model.
    """
    manifest = read_manifest(path)
    config = config_for_engine(check_model_manifest(manifest, path, layer_spec=layer_spec), dispatcher=dispatcher,
                               num_expert_slots=num_expert_slots, expert_backend=expert_backend,
                               input_sharded=input_sharded, sequence_parallel=sequence_parallel)
    placements = build_placements(config, state.ep.size, saved=placements_from_manifest(manifest))
    model = GPTMoEModel(config, state, placements=placements, device=device, dtype=dtype,
                        layer_spec=layer_spec)
    chunks = sharded_state_dict(model)
    load_checkpoint(path, chunks, verify_checksums=verify_checksums, group=world_group)
    _refuse_non_finite(path, chunks, allow_non_finite, world_group)
    return model


def _refuse_non_finite(path, chunks, allow: bool, world_group) -> None:
    """CheckpointError on every rank of ``world_group`` (or this process) when a rank's loaded chunks
    hold NaN or Inf, naming the first; only warnings with ``allow``."""
    finite = NonFiniteCheck(os.fspath(path), allow=allow, error=CheckpointError, doing="load")
    problem = None
    try:
        for chunk in chunks:
            finite(chunk.name, chunk.tensor)
    except CheckpointError as e:
        problem = str(e)
    if world_group is not None:
        problem = next((p for p in comms.all_gather_object(problem, world_group) if p), None)
    if problem is not None:
        raise CheckpointError(problem)
