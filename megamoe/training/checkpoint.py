"""Training checkpoints: all a run needs to continue where it stopped, under the same or any other layout.

A training checkpoint is one directory of the megamoe checkpoint format (:mod:`megamoe.checkpoint.format`):

- the model: the logical chunks of :func:`megamoe.checkpoint_state.sharded_state_dict` (routed experts
  under per-EXPERT names, so replicas are stored once and loading fills every slot of an expert);
- the optimizer state: ``optim.<key>.<logical name>``, cut exactly like its parameter
  (:func:`megamoe.checkpoint_state.optimizer_chunks`), so it follows the parameter into any layout: a
  slot that replicates an expert gets that expert's state, whether or not it was replicated before. The
  distributed optimizer's shards are gathered into these same logical tensors at save and sliced back at
  load, bucket by bucket through host memory (the device holds one bucket's gathered state at a time, never
  the full state; each bucket is written by one rank of its group, and a load reads of each state tensor
  only the slices holding the rank's own columns), so either optimizer resumes the
  other's checkpoints at any DP size; its fp32 master weights (bf16 parameters) are
  stored as the weights themselves, in fp32 (no ``master`` key). Gradients are not state: a checkpoint is
  taken between steps, so neither ``p.grad`` nor the fp32 gradient accumulation of bf16 parameters
  (``p.main_grad``, :mod:`megamoe.gradients`) is saved; a resumed bf16 run accumulates in fp32 from its
  first step;
- manifest fields: ``model_config`` (:meth:`GPTMoEConfig.to_dict`), ``parallel_layout`` (world
  size, tp, pp, dp, cp, ep, etp, order), ``expert_placement`` (``{"<layer id>": ExpertPlacement.to_dict()}``,
  each pipeline stage contributing its own layers) and ``extra`` (``step``, ``sampler_state``,
  ``has_optimizer_state``, ``verified_finite``, ``run_id``, ``training_state``: the LR schedule with its
  peak, the skip counters and the fp16 loss scale, see :meth:`Trainer.training_state`; for a model that
  came from HuggingFace also ``hf_config`` and ``hf_files``, see :class:`HFProvenance`);
- per-rank state: each rank's RNG states.

Directory scheme: step-numbered checkpoints ``<directory>/step_<step, 8 digits>`` (see
:func:`checkpoint_path`), each written atomically (temporary directory + rename, so a crash leaves the
older checkpoints intact); :func:`latest_checkpoint` finds what a resumed run loads and
:func:`prune_checkpoints` removes the old ones. Step-numbered rather than one directory overwritten in
place, so that a run can be rolled back past a bad step (a loss spike, a NaN) to an earlier checkpoint.

What pruning keeps. A save refuses non-finite parameters or optimizer state (a diverged run must not
replace good checkpoints with NaNs) and records ``verified_finite``. Finite is not enough (weights of
1e30 are finite): a save may also record ``health`` (:mod:`megamoe.training.checkpoint_health`), the
run's loss, grad norm and weight norm against the last good checkpoint's, with ``suspect`` naming what
went wrong. Pruning never deletes the newest GOOD checkpoint: verified finite and not suspect (older
checkpoints without the flag count as unknown), so a run that went bad can be rolled back to the newest
checkpoint written before the trouble began (:func:`last_good_checkpoint`). A save records the
``run_id`` it is given; pruning with a ``run_id`` deletes only that run's checkpoints, so a run never
loses its new checkpoints to the higher steps of another run sharing the directory, nor deletes them.

Every rank loads only the slices it holds, after the files it reads were checked against the manifest
(checksums by default; the ranks share out the hashing, see :mod:`megamoe.checkpoint.integrity`). The RNG
states are restored only when the layout is unchanged: under another layout a rank has no counterpart
whose streams it could continue.
"""

from __future__ import annotations

import datetime
import glob
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass

import torch

from megamoe import comms
from megamoe.checkpoint import checksums, integrity
from megamoe.checkpoint.format import (MANIFEST_FILE, CheckpointError, load_checkpoint, load_rank_state,
                                       planned_files, read_manifest, resolve_checkpoint, save_checkpoint)
from megamoe.checkpoint.manifest_fields import HF_FILES_DIR, placements_from_manifest
from megamoe.checkpoint.model_manifest import check_model_manifest, check_training_fields
from megamoe.checkpoint.side_files import verify_side_files
from megamoe.checkpoint_state import (LogicalChunk, chunks_by_parameter, materialize_optimizer_state,
                                      optimizer_chunks, same_view_of, sharded_state_dict)
from megamoe.models import GPTMoEModel
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.precision import has_non_finite

__all__ = [
    "HFProvenance", "save_training_checkpoint", "load_training_checkpoint", "expert_placements_from_checkpoint",
    "checkpoint_path", "list_checkpoints", "latest_checkpoint", "prune_checkpoints", "new_run_id", "checkpoint_run_id",
    "resolve_resume_checkpoint", "verify_resume_checkpoint", "is_good_checkpoint", "last_good_checkpoint",
    "previous_intact_checkpoint", "foreign_checkpoint_differences",
]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step_(\d+)(\.old)?")
# Config fields that choose how the engine computes, not what the model is: they may change on resume.
_ENGINE_FIELDS = {"moe.num_expert_slots", "moe.dispatcher", "moe.expert_backend", "moe.input_sharded",
                  "moe.shared_expert_overlap", "moe.deterministic", "recompute.granularity", "recompute.modules",
                  "sequence_parallel", "mtp_loss_coeff", "make_vocab_size_divisible_by"}
# How training balances the expert load: no weight depends on them, so a run may resume with others
# (as export_hf sets them aside).
_TRAINING_FIELDS = {"moe.router.aux_loss_coeff", "moe.router.seq_aux_loss_coeff", "moe.router.z_loss_coeff",
                    "moe.router.expert_bias_update_rate"}
# The side files that ARE the tokenizer (its companions only name special tokens): a run's tokenizer
# and a checkpoint's are the same when these files are.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass(frozen=True)
class HFProvenance:
    """What ``megamoe-convert export-hf`` needs from a model that came from HuggingFace: the original
    config.json (``config``) and the side files (tokenizer, generation config, ...: name -> bytes).

    ``import-hf`` stores both in the checkpoint it writes. Read them with :meth:`of_checkpoint` when a
    run starts from such a checkpoint and pass them to every :func:`save_training_checkpoint`, so that
    the fine-tuned checkpoints export without ``--hf-config``.
    """

    config: dict
    files: dict[str, bytes]

    @classmethod
    def of_checkpoint(cls, path: str | os.PathLike) -> "HFProvenance | None":
        """The provenance stored in the checkpoint ``path``; None for a model trained from scratch.
        Raises :class:`CheckpointError` if a recorded side file is missing or altered."""
        extra = read_manifest(path).get("extra") or {}
        if not extra.get("hf_config"):
            return None
        recorded = extra.get("hf_files") or {}
        directory = os.path.join(resolve_checkpoint(path), HF_FILES_DIR)
        problems = verify_side_files(directory, recorded)
        if problems:
            raise CheckpointError(f"{path}: {'; '.join(problems)}")
        files = {}
        for name in sorted(recorded):
            with open(os.path.join(directory, name), "rb") as f:
                files[name] = f.read()
        return cls(dict(extra["hf_config"]), files)

    def manifest_extra(self) -> dict:
        """The ``extra`` entries ``import-hf`` writes for these (sizes and checksums of the side files)."""
        return {"hf_config": self.config,
                "hf_files": {name: checksums.bytes_entry(data) for name, data in sorted(self.files.items())}}


def _parallel_layout(state) -> dict:
    return {"world_size": state.world_size, "tp": state.tp.size, "pp": state.pp.size, "dp": state.dp.size,
            "cp": state.cp.size, "ep": state.ep.size, "etp": state.etp.size, "order": state.order}


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    # Only when CUDA is already in use: querying its generator would otherwise initialise it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def _optimizer_has_state(optimizer: torch.optim.Optimizer) -> bool:
    """False before the first step (nothing to save); a partly initialised optimizer is refused by
    :func:`optimizer_chunks`, naming the parameter."""
    return any(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"])


def _logical_chunks(logical, by_param) -> list[LogicalChunk]:
    """The chunks of a distributed optimizer's logical state (a part of it, :class:`~megamoe.training.optimizer_state_checkpoint._LogicalState`): its
    state cut like a plain optimizer's, and the chunks of the parameters whose fp32 master it holds,
    viewing the master instead of the parameter (the checkpoint's weights are the master, in fp32)."""
    chunks = optimizer_chunks(logical, by_param)
    for param, master in logical.masters.items():
        chunks += [LogicalChunk(c.name, same_view_of(master, param, c.tensor), c.global_shape, c.offsets)
                   for c in by_param.get(param, ())]
    return chunks


def _model_chunks(trainer, with_optimizer: bool, *, saving: bool):
    """The model's chunks and the map of each parameter to its chunks (None without optimizer state);
    ``saving`` with a distributed optimizer, less the chunks of the parameters whose master it holds
    (those come with its logical state, :func:`_logical_chunks`, from the rank writing them). (A load
    reads them into the parameters as any weights, rounded to the parameter's dtype.)"""
    chunks = sharded_state_dict(trainer.model)
    if not with_optimizer:
        return chunks, None
    by_param = chunks_by_parameter(trainer.model.parameters(), chunks)
    master_parameters = getattr(trainer.optimizer, "master_parameters", None)
    if saving and master_parameters is not None:
        of_masters = {id(c) for p in master_parameters() for c in by_param.get(p, ())}
        chunks = [c for c in chunks if id(c) not in of_masters]
    return chunks, by_param


def _saved_chunks(trainer, with_optimizer: bool) -> list[LogicalChunk]:
    """What this rank writes: the chunks of the model and (``with_optimizer``) of its optimizer state.

    Distributed optimizer (:mod:`megamoe.training.distributed_optimizer`): its shards are gathered bucket
    by bucket into full-shape tensors in host memory, each bucket's by one rank of its group (collective;
    the device never holds the full state), and cut like a plain optimizer's state, so the checkpoint is
    the same either way."""
    chunks, by_param = _model_chunks(trainer, with_optimizer, saving=True)
    if not with_optimizer:
        return chunks
    optimizer = trainer.optimizer
    if hasattr(optimizer, "logical_state"):
        return chunks + _logical_chunks(optimizer.logical_state(), by_param)
    return chunks + optimizer_chunks(optimizer, by_param)


def _first_non_finite(chunks) -> tuple[str, int]:
    """(name of this rank's first chunk holding NaN or Inf, or "", how many such chunks): one
    ``isfinite`` reduction per block of each floating-point tensor."""
    bad = [c.name for c in chunks if has_non_finite(c.tensor)]
    return (bad[0] if bad else ""), len(bad)


def _refuse_non_finite(path, chunks, step: int, world_group) -> None:
    """Raise CheckpointError on EVERY rank if any rank holds a non-finite tensor (so none is left in
    the save's collectives), naming one; nothing is written."""
    reports = comms.all_gather_object(_first_non_finite(chunks), world_group)
    bad = [(rank, name, count) for rank, (name, count) in enumerate(reports) if count]
    if not bad:
        return
    rank, name, _ = bad[0]
    what = (f"optimizer state {name.split('.', 2)[1]!r} of parameter {name.split('.', 2)[2]!r}"
            if name.startswith("optim.") else f"parameter {name!r}")
    raise CheckpointError(
        f"refusing to save {path} at step {step}: {what} holds NaN or Inf (rank {rank}; "
        f"{sum(count for _, _, count in bad)} non-finite tensors in all); the training diverged. The earlier "
        "checkpoints are untouched: resume from one (e.g. with a lower learning rate)")


def save_training_checkpoint(path: str | os.PathLike, trainer, *, sampler_state: dict | None, world_group,
                             hf_provenance: HFProvenance | None = None, run_id: str | None = None,
                             side_files: dict[str, bytes] | None = None, health: dict | None = None) -> None:
    """Save ``trainer``'s model, optimizer state and step, ``sampler_state`` (the data position) and every
    rank's RNG states as the checkpoint directory ``path``, atomically. ``hf_provenance`` (of the
    checkpoint the run started from) is stored as ``import-hf`` stores it, so the result exports to HF.
    ``side_files`` (name -> bytes, e.g. the run's tokenizer files) are stored with the provenance's, as
    conversions store them (``hf_files/``, recorded in ``extra.hf_files``; these win over the provenance's
    files of the same name), so that generation finds the tokenizer in every checkpoint.
    ``run_id`` (see :func:`new_run_id`) marks the checkpoint as this run's for :func:`prune_checkpoints`;
    ``health`` (:meth:`megamoe.training.checkpoint_health.Health.to_dict`) is recorded as ``extra.health``.

    Collective over ``world_group`` (every rank of the run; ``None`` for one process): each rank passes
    its own trainer (its pipeline stage and shards) and the same ``path`` and ``run_id``. ``sampler_state``
    must be a JSON dict equal on every rank (e.g. :meth:`ResumableSampler.state_dict`, which is
    layout-independent). Until the save completes, ``path`` keeps what it held before.

    Raises :class:`CheckpointError` on every rank, before writing anything, if a parameter or optimizer
    state tensor holds NaN or Inf (the message names one); the checkpoint records ``verified_finite``.
    """
    model, state = trainer.model, trainer.state
    with_optimizer = _optimizer_has_state(trainer.optimizer)
    chunks = _saved_chunks(trainer, with_optimizer)
    _refuse_non_finite(path, chunks, trainer.step, world_group)
    fields = {
        "model_config": model.config.to_dict(),
        "parallel_layout": _parallel_layout(state),
        "expert_placement": {str(i): layer.placement.to_dict() for i, layer in model.moe_layers().items()},
        "extra": {"step": trainer.step, "sampler_state": sampler_state, "has_optimizer_state": with_optimizer,
                  "verified_finite": True, "training_state": trainer.training_state(),
                  **({"run_id": run_id} if run_id is not None else {}),
                  **({"health": health} if health is not None else {}),
                  **(hf_provenance.manifest_extra() if hf_provenance is not None else {})},
    }
    files = {**(hf_provenance.files if hf_provenance is not None else {}), **(side_files or {})}
    if files:
        fields["extra"]["hf_files"] = {name: checksums.bytes_entry(data) for name, data in sorted(files.items())}
    extra_files = {f"{HF_FILES_DIR}/{name}": data for name, data in files.items()}
    # verify_replicas: copies of one chunk (DP replicas, expert replicas in several slots) must be
    # bitwise equal; they are stored once, so a divergence is caught here, naming the tensor.
    save_checkpoint(path, chunks, group=world_group, manifest_fields=fields,
                    rank_state=_rng_state(), verify_replicas=True, extra_files=extra_files)
    logger.info("saved training checkpoint %s at step %d", path, trainer.step)


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value}


def _config_differences(saved: dict, current: dict, ignore=_ENGINE_FIELDS) -> list[str]:
    """Dotted names of the model-defining fields that differ (the fields in ``ignore`` may change freely)."""
    saved, current = _flatten(saved), _flatten(current)
    return sorted(k for k in saved.keys() | current.keys()
                  if k not in ignore and saved.get(k) != current.get(k))


def foreign_checkpoint_differences(path: str | os.PathLike, model_config: dict,
                                   tokenizer_files: dict[str, bytes] | None) -> list[str]:
    """What makes the checkpoint ``path`` another model than a run of ``model_config``
    (:meth:`GPTMoEConfig.to_dict`) with the tokenizer ``tokenizer_files`` (name -> bytes, None: no
    tokenizer): each differing model field as ``name saved -> current``, and the tokenizer when the
    checkpoint records one (``extra.hf_files``) that is not this one. Empty: the same model. Engine choices
    and the load-balancing coefficients may differ (they change no weight's meaning)."""
    manifest = read_manifest(path)
    saved_config = manifest.get("model_config") or {}
    saved, current = _flatten(saved_config), _flatten(model_config)
    differences = [f"{name} {saved.get(name)!r} -> {current.get(name)!r}" for name in _config_differences(
        saved_config, model_config, ignore=_ENGINE_FIELDS | _TRAINING_FIELDS)]
    recorded = sorted(name for name in (manifest.get("extra") or {}).get("hf_files") or {}
                      if name in _TOKENIZER_FILES)
    if recorded and tokenizer_files is not None:
        directory = os.path.join(resolve_checkpoint(path), HF_FILES_DIR)
        ours = {name: data for name, data in tokenizer_files.items() if name in _TOKENIZER_FILES}
        if sorted(ours) != recorded or any(_read_or_none(os.path.join(directory, name)) != ours[name]
                                           for name in recorded):
            differences.append(f"the tokenizer ({', '.join(recorded)} in {directory} is not this run's "
                               f"{', '.join(sorted(ours)) or 'tokenizer'})")
    return differences


def _read_or_none(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _check_lr_schedule(path, extra: dict, trainer, override_lr_schedule: bool) -> None:
    """The LR schedule is a function of the step: resuming with another one jumps to another LR curve.
    As Megatron (without ``--override-opt-param-scheduler``): an error naming what changed, unless the
    caller overrides (then a warning)."""
    current, saved_state = trainer.training_state()["lr_schedule"], extra.get("training_state")
    if saved_state is None:
        logger.info("%s records no LR schedule (converted, or saved before schedules were recorded): this run's "
                    "applies (peak LR %g, %s)", path, trainer.config.lr, trainer.config.lr_schedule)
        return
    saved = saved_state["lr_schedule"]
    changes = [f"{k} {saved.get(k)!r} -> {current.get(k)!r}" for k in sorted(saved.keys() | current.keys())
               if saved.get(k) != current.get(k)]
    if not changes:
        return
    if override_lr_schedule:
        logger.warning("%s: the LR schedule changed (%s); overriding it: this run's schedule from step %d on",
                       path, ", ".join(changes), extra["step"])
        return
    raise CheckpointError(
        f"{path} was saved with another LR schedule: {', '.join(changes)}. Resume with the saved schedule, or "
        "override it to continue with this one (override_lr_schedule=True; the script's "
        "--override-opt-param-scheduler)")


def load_training_checkpoint(path: str | os.PathLike, trainer, *, world_group, verify_checksums: bool = True,
                             override_lr_schedule: bool = False) -> dict:
    """Load the checkpoint ``path`` into ``trainer`` (model, optimizer state, step, skip counters, fp16 loss
    scale), whatever layout, number of expert slots or placement saved it; restore this rank's RNG states
    if the layout is the same. Each rank reads only its own slices.

    A checkpoint saved with another LR schedule (peak LR included) raises :class:`CheckpointError` naming
    the changes, before anything is loaded, unless ``override_lr_schedule`` (then a warning, and the
    trainer's schedule continues from the saved step).

    Every file is checked against the manifest before it is read: its size, and its checksum unless
    ``verify_checksums=False``. Collective over ``world_group`` (every rank of the run; ``None`` for one
    process): the ranks share out the hashing so that each file is hashed by one rank, once, and a
    damaged file fails every rank with the same error (see :mod:`megamoe.checkpoint.integrity`).

    Returns ``{"step": int, "sampler_state": dict | None}``: hand ``sampler_state`` to the data sampler
    (:meth:`ResumableSampler.load_state_dict`) to continue with the next samples.
    Raises :class:`megamoe.checkpoint.format.CheckpointError` if a tensor is missing or has another shape,
    or a file is damaged.
    """
    root = resolve_checkpoint(path)
    manifest = read_manifest(root)
    model, optimizer = trainer.model, trainer.optimizer
    if isinstance(model, GPTMoEModel):
        check_model_manifest(manifest, root, layer_spec=model.layer_spec)
    else:                   # another TrainableModel: its config and tensors are its class's own
        check_training_fields(manifest, root)
    extra = manifest["extra"]
    _check_lr_schedule(path, extra, trainer, override_lr_schedule)
    differences = _config_differences(manifest["model_config"], model.config.to_dict())
    if differences:
        logger.warning("%s was saved with another model config; differing fields: %s", path, ", ".join(differences))
    if extra["has_optimizer_state"]:
        materialize_optimizer_state(optimizer)
    else:
        optimizer.state.clear()  # saved before the first step: a fresh optimizer is the exact state
    with_optimizer = extra["has_optimizer_state"]
    chunks, by_param = _model_chunks(trainer, with_optimizer, saving=False)
    # A distributed optimizer's state is read bucket by bucket into host buffers, only the slices holding
    # this rank's columns, each bucket's taken into its shards before the next is read
    # (:meth:`DistributedOptimizer.logical_state_buckets`, :meth:`~DistributedOptimizer.owned_chunks`); the
    # plain optimizer's is read into its state tensors with the model.
    by_bucket = with_optimizer and hasattr(optimizer, "logical_state_buckets")
    if with_optimizer and not by_bucket:
        chunks += optimizer_chunks(optimizer, by_param)
    planned = list(chunks)
    if by_bucket:
        for part in optimizer.logical_state_buckets(planning=True):    # (whole tensors: a superset of files)
            planned += _logical_chunks(part, by_param)
    layout = _parallel_layout(trainer.state)
    rank = comms.group_rank(world_group)
    restore_rng = manifest["parallel_layout"] == layout and str(rank) in manifest.get("rank_state", {})

    # Every file this rank reads (model, optimizer, rank state) checked in one collective step; the loads
    # below find them verified and do not hash them again.
    files, error = set(), None
    try:
        files = planned_files(root, planned, rank_state_of=rank if restore_rng else None)
    except Exception as e:  # noqa: BLE001 - re-raised by verify_files, after the other ranks heard of it
        error = e
    integrity.verify_files(root, manifest, files, verify_checksums=verify_checksums, group=world_group,
                           local_error=error)
    load_checkpoint(root, chunks, verify_checksums=verify_checksums)
    if by_bucket:
        for part in optimizer.logical_state_buckets():
            load_checkpoint(root, optimizer.owned_chunks(_logical_chunks(part, by_param), part),
                            verify_checksums=verify_checksums)
            optimizer.load_logical_state(part)
    trainer.step = extra["step"]
    trainer.load_training_state(extra.get("training_state") or {})

    if restore_rng:
        rng = load_rank_state(root, rank, verify_checksums=verify_checksums)
        torch.set_rng_state(rng["torch_cpu"])
        if "torch_cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["torch_cuda"])
    else:
        logger.warning("%s holds no RNG state for this layout (%s; this run: %s): RNG states are not restored",
                       path, manifest["parallel_layout"], layout)
    logger.info("loaded training checkpoint %s at step %d", path, trainer.step)
    return {"step": extra["step"], "sampler_state": extra["sampler_state"]}


def expert_placements_from_checkpoint(path: str | os.PathLike) -> dict[int, ExpertPlacement]:
    """The saved expert placement of every MoE layer, to rebuild the model with the placement a run had
    reached (e.g. after rebalancing) when it resumes with the same number of slots and EP size."""
    return placements_from_manifest(read_manifest(path))


# ----------------------------------------------------------------------------------------------
# Step-numbered checkpoint directories
# ----------------------------------------------------------------------------------------------
def checkpoint_path(directory: str | os.PathLike, step: int) -> str:
    """Where the checkpoint of ``step`` lives: ``<directory>/step_<8 digits>``."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return os.path.join(os.fspath(directory), f"step_{step:08d}")


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint in ``directory``, oldest first.

    A save interrupted mid-way left only a temporary directory (ignored); one interrupted while swapping
    a re-saved step left ``step_N.old`` (listed as ``step_N``: loading reads the ``.old`` directory).
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    found: dict[int, str] = {}
    for name in os.listdir(directory):
        match = _STEP_DIR.fullmatch(name)
        if match is None or not os.path.isfile(os.path.join(directory, name, MANIFEST_FILE)):
            continue
        path = os.path.join(directory, name.removesuffix(".old"))
        if match.group(2) and os.path.exists(path):
            continue  # a complete step_N exists next to its stale .old
        found[int(match.group(1))] = path
    return sorted(found.items())


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint in ``directory`` (``None`` when there is none): what to resume from."""
    checkpoints = list_checkpoints(directory)
    return checkpoints[-1][1] if checkpoints else None


def _checkpoint_step(path: str) -> int | None:
    step = _saved_extra(path).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def resolve_resume_checkpoint(location: str | os.PathLike, step: int | None = None) -> str:
    """The checkpoint to resume from ``location``: a checkpoint directory itself (e.g. one ``step_N``
    folder), or a directory of step-numbered checkpoints, whose ``step`` (default: the newest) is taken.
    Raises CheckpointError saying what ``location`` holds instead."""
    location = os.fspath(location)
    if os.path.isfile(os.path.join(location, MANIFEST_FILE)):
        saved = _checkpoint_step(location)
        if step is not None and saved != step:
            raise CheckpointError(f"{location} is the checkpoint of step {saved}, not of step {step}: name the folder "
                                  "that holds it, or its step folder")
        return location
    checkpoints = dict(list_checkpoints(location))
    if not checkpoints:
        raise CheckpointError(f"{location}: no complete checkpoint found there (neither a checkpoint folder nor a "
                              "folder of step_N checkpoints)")
    if step is None:
        return checkpoints[max(checkpoints)]
    if step not in checkpoints:
        raise CheckpointError(f"{location} holds no checkpoint of step {step}; its steps: "
                              f"{', '.join(str(s) for s in sorted(checkpoints))}")
    return checkpoints[step]


def is_good_checkpoint(extra: dict) -> bool:
    """Whether a checkpoint's manifest ``extra`` says it is good: verified finite, and not found suspect
    against the run's last good checkpoint (:mod:`megamoe.training.checkpoint_health`)."""
    health = extra.get("health")
    return extra.get("verified_finite") is True and not (isinstance(health, dict) and health.get("suspect"))


def last_good_checkpoint(directory: str | os.PathLike, *, before_step: int | None = None) -> str | None:
    """The newest good checkpoint (:func:`is_good_checkpoint`) in ``directory``, of a step below
    ``before_step`` if given; None: there is none."""
    good = [path for step, path in list_checkpoints(directory)
            if (before_step is None or step < before_step) and is_good_checkpoint(_saved_extra(path))]
    return good[-1] if good else None


def previous_intact_checkpoint(path: str | os.PathLike, *, world_group=None) -> str | None:
    """The newest checkpoint before ``path`` (a ``step_N`` folder) in its directory whose files all match
    its manifest (sizes and checksums): what to resume from when ``path`` turns out damaged. Collective
    over ``world_group``: the ranks share out the hashing. None: no earlier checkpoint is intact."""
    directory, name = os.path.split(os.path.normpath(os.fspath(path)))
    match = _STEP_DIR.fullmatch(name)
    if match is None:
        return None
    for _, candidate in reversed([c for c in list_checkpoints(directory) if c[0] < int(match.group(1))]):
        try:
            root = resolve_checkpoint(candidate)
            manifest = read_manifest(root)
            integrity.verify_files(root, manifest, manifest["files"], group=world_group)
        except (CheckpointError, OSError, ValueError, KeyError, TypeError):
            continue
        return candidate
    return None


def verify_resume_checkpoint(path: str | os.PathLike, *, world_group) -> None:
    """Check every file of the checkpoint ``path`` against its manifest (sizes and checksums) before a run
    resumes from it: collective over ``world_group``, the ranks share out the hashing, and the load that
    follows finds the files verified (no second hashing). A damaged file raises CheckpointError naming it
    and the newest earlier checkpoint of the same directory that is intact (:func:`previous_intact_checkpoint`)."""
    root = resolve_checkpoint(path)
    manifest = read_manifest(root)
    try:
        integrity.verify_files(root, manifest, manifest["files"], group=world_group)
    except CheckpointError as e:
        previous = previous_intact_checkpoint(path, world_group=world_group)
        advice = (f"the previous intact checkpoint is {previous} (step {_checkpoint_step(previous)}): resume from it "
                  f"(pretrain_moe.py: --load-step {_checkpoint_step(previous)})" if previous is not None else
                  f"no earlier checkpoint in {os.path.dirname(os.path.normpath(os.fspath(path)))} is intact")
        raise CheckpointError(f"{e}; {advice}") from None


def new_run_id() -> str:
    """A fresh run id for :func:`save_training_checkpoint` / :func:`prune_checkpoints`: the UTC start
    time and a random suffix. Create it on one rank and share it: every rank must pass the same."""
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(4)}"


def _saved_extra(path: str) -> dict:
    """The manifest's ``extra`` of ``path``; {} when unreadable (such a checkpoint counts as unknown)."""
    try:
        extra = read_manifest(path).get("extra")
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return {}
    return extra if isinstance(extra, dict) else {}


def checkpoint_run_id(path: str | os.PathLike) -> str | None:
    """The ``run_id`` the checkpoint ``path`` was saved with (None: none recorded)."""
    run_id = _saved_extra(os.fspath(path)).get("run_id")
    return run_id if isinstance(run_id, str) else None


def prune_checkpoints(directory: str | os.PathLike, keep_last: int, *, run_id: str | None = None) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and what interrupted saves of older
    steps left behind. Call it on ONE rank, after a save has returned. Returns the deleted paths.

    With ``run_id`` only that run's checkpoints (saved with the same ``run_id``) count and may go:
    another run's, or one without a run id, is never deleted, whatever its step, and nor is what an
    interrupted save left at a step that is not pruned here. In every case the newest good checkpoint
    (:func:`is_good_checkpoint`: verified finite, not suspect) is kept, so a run whose last checkpoints
    went bad can still be rolled back to the newest one written before the trouble began.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is never deleted), got {keep_last}")
    checkpoints = list_checkpoints(directory)
    extras = {path: _saved_extra(path) for _, path in checkpoints}
    good = [path for _, path in checkpoints if is_good_checkpoint(extras[path])]
    protected = set(good[-1:])
    if run_id is not None:
        checkpoints = [(step, path) for step, path in checkpoints if extras[path].get("run_id") == run_id]
    if not checkpoints:
        return []
    oldest_kept = checkpoints[-keep_last:][0][0]
    removed, pruned_steps = [], set()
    for step, path in checkpoints[:-keep_last]:
        if path not in protected:
            removed += [p for p in (path, path + ".old") if os.path.exists(p)]
            pruned_steps.add(step)
    for leftover in glob.glob(os.path.join(glob.escape(os.fspath(directory)), "step_*.tmp-*")):
        match = re.fullmatch(r"step_(\d+)\.tmp-.*", os.path.basename(leftover))
        # A leftover names no run: with a run id, only those of the steps pruned here (another run
        # sharing the directory may be writing its own save right now).
        if match and (int(match.group(1)) in pruned_steps if run_id is not None
                      else int(match.group(1)) < oldest_kept):
            removed.append(leftover)
    for path in removed:
        shutil.rmtree(path)
    if removed:
        logger.info("pruned %d old checkpoint directories in %s", len(removed), directory)
    return removed
