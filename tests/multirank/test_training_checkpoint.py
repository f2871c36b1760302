"""Training checkpoints: a resumed run continues bitwise (in process, after SIGKILL, after a death in the
middle of a save), optimizer state follows experts into replica slots, step-numbered directories, and a
checkpoint saved under one layout resumes under others on the single-process loss curve.

The cases that spawn ranks or run scripts end to end; the in-process ones are in
tests/unit/test_training_checkpoint.py."""

import glob
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megamoe.checkpoint.format import CheckpointError, read_manifest
from tests.helpers.checkpointed_training import DIED_IN_SAVE, build_sampler, build_trainer, dataset, train_steps
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training.checkpoint import (checkpoint_path, latest_checkpoint, list_checkpoints,
                                         load_training_checkpoint, save_training_checkpoint)

from tests.helpers.tiny_model import E
from tests.helpers.training_checkpoint import _assert_close, _single

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "checkpointed_training.py")


pytestmark = pytest.mark.usefixtures("one_thread")


def _reference_losses(num_steps):
    """The uninterrupted single-process run, as the script trains it."""
    state = _single()
    return train_steps(build_trainer(state), build_sampler(state), dataset(), num_steps)


def _resume_single_process(path, num_steps):
    """(step resumed from, the losses of the next ``num_steps`` steps) of one process resuming ``path``."""
    state = _single()
    trainer, sampler = build_trainer(state), build_sampler(state)
    extra = load_training_checkpoint(path, trainer, world_group=None)
    sampler.load_state_dict(extra["sampler_state"])
    return extra["step"], train_steps(trainer, sampler, dataset(), num_steps)


def _parse(lines):
    return [json.loads(line) for line in lines if line.strip()]


def _non_finite_on_one_rank_worker(rank, world_size, path):
    """dp 2: only rank 1 holds a NaN; both ranks must refuse (and none hang in the save)."""
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    state = initialize_model_parallel()
    trainer = build_trainer(state, world_group=dist.group.WORLD)
    if rank == 1:
        with torch.no_grad():
            trainer.model.embed_tokens.weight.view(-1)[0] = float("nan")
    try:
        save_training_checkpoint(path, trainer, sampler_state=None, world_group=dist.group.WORLD)
    except CheckpointError as e:
        return str(e)
    finally:
        destroy_model_parallel()
    return None


@pytest.mark.slow
def test_every_rank_refuses_a_non_finite_save_together(tmp_path):
    path = str(tmp_path / "ckpt")
    errors = run_on_ranks(_non_finite_on_one_rank_worker, 2, args=(path,), timeout_s=240)
    assert errors[0] == errors[1] and "parameter 'embed_tokens.weight' holds NaN or Inf (rank 1" in errors[0]
    assert not os.listdir(tmp_path)


# ----------------------------------------------------------------------------------------------
# Killed processes
# ----------------------------------------------------------------------------------------------
def _script(directory, until_step, *more):
    return [sys.executable, SCRIPT, "--dir", str(directory), "--until-step", str(until_step), *more]


@pytest.mark.slow
def test_resume_after_sigkill_matches_the_uninterrupted_run(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(_script(ckpt_dir, 1000), stdout=subprocess.PIPE, stderr=stderr, text=True)
        killed = []
        try:
            while not killed or killed[-1].get("step", 0) < 2:
                line = proc.stdout.readline()
                assert line, f"the training process ended early: {(tmp_path / 'stderr').read_text()}"
                killed.append(json.loads(line))
            os.kill(proc.pid, signal.SIGKILL)                     # wherever it is: mid-step or mid-save
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    (resume_step, resume_path), = list_checkpoints(ckpt_dir)[-1:]
    assert resume_step >= 2 and resume_path == latest_checkpoint(ckpt_dir)

    done = subprocess.run(_script(ckpt_dir, resume_step + 2), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    resumed = _parse(done.stdout.splitlines())
    assert resumed[0] == {"resumed_from": resume_step}
    reference = _reference_losses(resume_step + 2)
    assert [x["loss"] for x in killed[1:]] == reference[:len(killed) - 1]
    assert [x["step"] for x in resumed[1:]] == [resume_step + 1, resume_step + 2]
    assert [x["loss"] for x in resumed[1:]] == reference[resume_step:]


@pytest.mark.slow
def test_death_during_save_keeps_the_previous_checkpoint(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    died = subprocess.run(_script(ckpt_dir, 3, "--die-during-save-at", "3"), capture_output=True, text=True,
                          timeout=240)
    assert died.returncode == DIED_IN_SAVE, died.stderr
    assert [x.get("step") for x in _parse(died.stdout.splitlines())] == [None, 1, 2]
    half_written = glob.glob(str(checkpoint_path(ckpt_dir, 3)) + ".tmp-*")
    assert len(half_written) == 1 and os.path.isfile(os.path.join(half_written[0], "manifest.json"))
    assert latest_checkpoint(ckpt_dir) == checkpoint_path(ckpt_dir, 2)

    reference = _reference_losses(4)
    state = _single()
    trainer, sampler = build_trainer(state), build_sampler(state)
    extra = load_training_checkpoint(latest_checkpoint(ckpt_dir), trainer, world_group=None)
    sampler.load_state_dict(extra["sampler_state"])
    assert extra["step"] == 2
    assert train_steps(trainer, sampler, dataset(), 1) == reference[2:3]
    save_training_checkpoint(checkpoint_path(ckpt_dir, 3), trainer, sampler_state=sampler.state_dict(),
                             world_group=None)
    assert not glob.glob(str(checkpoint_path(ckpt_dir, 3)) + ".tmp-*")   # this save of step 3 cleaned up
    assert train_steps(trainer, sampler, dataset(), 1) == reference[3:]
    assert latest_checkpoint(ckpt_dir) == checkpoint_path(ckpt_dir, 3)


# ----------------------------------------------------------------------------------------------
# Another layout
# ----------------------------------------------------------------------------------------------
def _save_worker(rank, world_size, path):
    """2 ranks, TP 2 x EP 2, all-gather dispatcher, one slot per expert: train 2 steps and save."""
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    state = initialize_model_parallel(tp=2, ep=2)
    trainer = build_trainer(state, "allgather", E, dist.group.WORLD)
    sampler = build_sampler(state)
    losses = train_steps(trainer, sampler, dataset(), 2)
    save_training_checkpoint(path, trainer, sampler_state=sampler.state_dict(), world_group=dist.group.WORLD)
    destroy_model_parallel()
    return losses


RESUME_LAYOUTS = {                       # name: (parallel sizes, dispatcher, expert slots)
    "dp4 ep4 alltoall 2E slots": (dict(ep=4), "alltoall", 2 * E),
    "pp2 dp2 ep2 alltoall E+2 slots": (dict(pp=2, ep=2), "alltoall", E + 2),
}


def _resume_worker(rank, world_size, path, save_path):
    """4 ranks: resume ``path`` under each RESUME_LAYOUTS entry for 2 steps; the pipeline layout saves again."""
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    results = {}
    for name, (sizes, dispatcher, slots) in RESUME_LAYOUTS.items():
        state = initialize_model_parallel(**sizes)
        trainer, sampler = build_trainer(state, dispatcher, slots, dist.group.WORLD), build_sampler(state)
        extra = load_training_checkpoint(path, trainer, world_group=dist.group.WORLD)
        sampler.load_state_dict(extra["sampler_state"])
        results[name] = (extra["step"], train_steps(trainer, sampler, dataset(), 2))
        if state.pp.size > 1:
            save_training_checkpoint(save_path, trainer, sampler_state=sampler.state_dict(),
                                     world_group=dist.group.WORLD)
        destroy_model_parallel()
    return results


@pytest.mark.slow
def test_resume_under_other_layouts_stays_on_the_single_process_curve(tmp_path):
    reference = _reference_losses(5)
    saved, pipelined = str(tmp_path / "tp2_ep2"), str(tmp_path / "pp2_ep2")

    before = run_on_ranks(_save_worker, 2, args=(saved,), timeout_s=300)
    assert before[0] == before[1]
    _assert_close(before[0], reference[:2], "tp2 ep2 allgather before the save")

    after = run_on_ranks(_resume_worker, 4, args=(saved, pipelined), timeout_s=300)
    for name in RESUME_LAYOUTS:
        assert all(r[name] == after[0][name] for r in after), name     # every rank reports the global loss
        step, losses = after[0][name]
        assert step == 2
        _assert_close(losses, reference[2:4], f"resumed under {name}")

    step, losses = _resume_single_process(saved, 2)
    assert step == 2
    _assert_close(losses, reference[2:4], "resumed in one process")

    manifest = read_manifest(pipelined)                          # both pipeline stages gave their layers
    assert manifest["parallel_layout"] | {"order": None} == dict(world_size=4, tp=1, pp=2, dp=2, cp=1, ep=2, etp=1,
                                                                 order=None)
    assert sorted(manifest["expert_placement"]) == ["1", "2", "3"]
    assert all(len(p["slot_to_expert"]) == E + 2 for p in manifest["expert_placement"].values())
    step, losses = _resume_single_process(pipelined, 1)
    assert step == 4
    _assert_close(losses, reference[4:], "pipelined checkpoint resumed in one process")
