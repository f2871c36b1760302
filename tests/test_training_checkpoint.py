"""Training checkpoints: a resumed run continues bitwise (in process, after SIGKILL, after a death in the
middle of a save), optimizer state follows experts into replica slots, step-numbered directories, and a
checkpoint saved under one layout resumes under others on the single-process loss curve."""

import glob
import json
import logging
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from checkpoint_tools.format import CheckpointError, read_manifest, save_checkpoint
from checkpointed_training import DIED_IN_SAVE, build_sampler, build_trainer, dataset, train_steps
from megamoe.checkpoint_state import chunks_by_parameter, optimizer_chunks, sharded_state_dict
from megamoe.models import GPTMoEConfig
from megamoe.moe.expert_slots import ExpertPlacement
from megamoe.testing import run_on_ranks
from megamoe.training.checkpoint import (checkpoint_path, checkpoint_run_id, expert_placements_from_checkpoint,
                                         latest_checkpoint, list_checkpoints, load_training_checkpoint,
                                         new_run_id, prune_checkpoints, save_training_checkpoint)
from test_training import E, REL_TOL

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpointed_training.py")


def _single():
    from parallel_state import ParallelState
    return ParallelState.single_process()


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


def _assert_close(got, want, what):
    assert len(got) == len(want), what
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= REL_TOL * abs(w), f"{what}: loss {step}: {g} vs {w}"


def _all_chunks(trainer):
    """Every logical chunk of the trainer's model and optimizer (full tensors in one process)."""
    chunks = sharded_state_dict(trainer.model)
    return chunks + optimizer_chunks(trainer.optimizer, chunks_by_parameter(trainer.model.parameters(), chunks))


def _parse(lines):
    return [json.loads(line) for line in lines if line.strip()]


# ----------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------
def test_resume_in_process_continues_bitwise(tmp_path):
    state, data = _single(), dataset()
    trainer, sampler = build_trainer(state), build_sampler(state)
    save_training_checkpoint(checkpoint_path(tmp_path, 0), trainer, sampler_state=sampler.state_dict(),
                             world_group=None)                       # before the first optimizer step
    first = train_steps(trainer, sampler, data, 3)
    path = checkpoint_path(tmp_path, 3)
    save_training_checkpoint(path, trainer, sampler_state=sampler.state_dict(), world_group=None)
    random_after_save = torch.rand(4)
    then = train_steps(trainer, sampler, data, 3)

    manifest = read_manifest(path)
    assert manifest["parallel_layout"] == {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "etp": 1,
                                           "order": state.order}
    assert manifest["expert_placement"] == {str(i): ExpertPlacement.default(E, E, 1).to_dict() for i in (1, 2, 3)}
    assert GPTMoEConfig.from_dict(manifest["model_config"]) == trainer.model.config
    assert any(name.startswith("optim.exp_avg.layers.1.mlp.experts.3.") for name in manifest["tensors"])

    torch.manual_seed(999)                                           # the load must restore the generator
    resumed, resumed_sampler = build_trainer(state), build_sampler(state)
    extra = load_training_checkpoint(path, resumed, world_group=None)
    assert extra == {"step": 3, "sampler_state": build_sampler(state).state_dict() | {"consumed_samples": 24}}
    assert resumed.step == 3
    assert torch.equal(torch.rand(4), random_after_save)
    resumed_sampler.load_state_dict(extra["sampler_state"])
    assert train_steps(resumed, resumed_sampler, data, 3) == then
    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name

    # Back to step 0 with a trainer that has optimizer state: the state must go, the run restart exactly.
    extra = load_training_checkpoint(checkpoint_path(tmp_path, 0), resumed, world_group=None)
    assert extra["step"] == 0 and resumed.step == 0
    resumed_sampler.load_state_dict(extra["sampler_state"])
    assert train_steps(resumed, resumed_sampler, data, 6) == first + then


def test_optimizer_state_follows_experts_into_replica_slots(tmp_path, caplog):
    state, data = _single(), dataset()
    source, sampler = build_trainer(state), build_sampler(state)   # one slot per expert
    train_steps(source, sampler, data, 2)
    save_training_checkpoint(tmp_path / "one_slot_each", source, sampler_state=sampler.state_dict(),
                             world_group=None)

    placement = ExpertPlacement([3, 0, 1, 2, 2, 1, 0, 3], E, 1)   # every expert in two slots, shuffled
    replicated = build_trainer(state, num_slots=2 * E, placements={i: placement for i in (1, 2, 3)})
    with caplog.at_level(logging.WARNING, logger="megamoe.training.checkpoint"):
        extra = load_training_checkpoint(tmp_path / "one_slot_each", replicated, world_group=None)
    assert not caplog.records, "the number of slots is an engine choice: no config-mismatch warning"
    saved = {c.name: c.tensor for c in _all_chunks(source)}
    loaded = _all_chunks(replicated)
    for chunk in loaded:                 # weights and AdamW moments of each slot = its expert's
        assert torch.equal(chunk.tensor, saved[chunk.name]), chunk.name
    gate_moments = [c for c in loaded if c.name == "optim.exp_avg_sq.layers.2.mlp.experts.1.gate_proj.weight"]
    assert len(gate_moments) == 2 and gate_moments[0].tensor.abs().sum() > 0

    replicated_sampler = build_sampler(state)
    replicated_sampler.load_state_dict(extra["sampler_state"])
    _assert_close(train_steps(replicated, replicated_sampler, data, 2), train_steps(source, sampler, data, 2),
                  "2E slots vs E slots")

    save_training_checkpoint(tmp_path / "replicated", replicated, sampler_state=None, world_group=None)
    assert expert_placements_from_checkpoint(tmp_path / "replicated") == {i: placement for i in (1, 2, 3)}
    stored = read_manifest(tmp_path / "replicated")["tensors"]["layers.1.mlp.experts.0.up_proj.weight"]
    assert len(stored["chunks"]) == 1                              # replicas stored once


def test_step_directories_latest_and_prune(tmp_path):
    def make(name, complete=True):
        os.makedirs(tmp_path / name)
        if complete:
            (tmp_path / name / "manifest.json").write_text("{}")

    assert latest_checkpoint(tmp_path / "absent") is None
    for name in ("step_00000001", "step_00000002", "step_00000002.old", "step_00000005", "step_00000006.old",
                 "step_00000003.tmp-0a1b", "step_00000007.tmp-2c3d"):
        make(name)
    make("step_00000009", complete=False)                          # not a checkpoint: never listed
    make("notes")
    assert list_checkpoints(tmp_path) == [(s, checkpoint_path(tmp_path, s)) for s in (1, 2, 5, 6)]
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 6)   # step 6 lives in .old

    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(os.path.basename(p) for p in removed) == [
        "step_00000001", "step_00000002", "step_00000002.old", "step_00000003.tmp-0a1b"]
    assert sorted(os.listdir(tmp_path)) == ["notes", "step_00000005", "step_00000006.old", "step_00000007.tmp-2c3d",
                                            "step_00000009"]
    with pytest.raises(ValueError, match="keep_last"):
        prune_checkpoints(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="step"):
        checkpoint_path(tmp_path, -1)


def _fake_checkpoint(directory, step, **extra):
    """A checkpoint with no tensors and the given manifest ``extra``: what pruning reads."""
    save_checkpoint(checkpoint_path(directory, step), [], manifest_fields={"extra": {"step": step, **extra}})


def _steps(directory):
    return [step for step, _ in list_checkpoints(directory)]


def test_pruning_leaves_another_runs_higher_steps_alone(tmp_path):
    """The rerun case: an older run's step 100 and 120 are there; the new run's own checkpoints are
    pruned among themselves only, never deleted because the older run's rank higher."""
    old_run, new_run = new_run_id(), new_run_id()
    assert old_run != new_run
    for step in (100, 120):
        _fake_checkpoint(tmp_path, step, run_id=old_run, verified_finite=True)
    _fake_checkpoint(tmp_path, 20, run_id=new_run, verified_finite=True)
    assert prune_checkpoints(tmp_path, keep_last=2, run_id=new_run) == []
    assert checkpoint_run_id(checkpoint_path(tmp_path, 20)) == new_run
    _fake_checkpoint(tmp_path, 40, run_id=new_run, verified_finite=True)
    assert prune_checkpoints(tmp_path, keep_last=2, run_id=new_run) == []
    _fake_checkpoint(tmp_path, 60, run_id=new_run, verified_finite=True)
    assert prune_checkpoints(tmp_path, keep_last=2, run_id=new_run) == [checkpoint_path(tmp_path, 20)]
    assert _steps(tmp_path) == [40, 60, 100, 120]
    _fake_checkpoint(tmp_path, 5)                                   # no run id: never this run's
    assert prune_checkpoints(tmp_path, keep_last=1, run_id=new_run) == [checkpoint_path(tmp_path, 40)]
    assert _steps(tmp_path) == [5, 60, 100, 120]


def test_pruning_keeps_the_newest_checkpoint_verified_finite(tmp_path):
    for step in (1, 2):
        _fake_checkpoint(tmp_path, step, verified_finite=True)
    for step in (3, 4):
        _fake_checkpoint(tmp_path, step)                            # older code: finiteness unknown
    assert prune_checkpoints(tmp_path, keep_last=2) == [checkpoint_path(tmp_path, 1)]
    assert _steps(tmp_path) == [2, 3, 4]
    assert prune_checkpoints(tmp_path, keep_last=1) == [checkpoint_path(tmp_path, 3)]
    assert _steps(tmp_path) == [2, 4]


def test_save_refuses_non_finite_parameters_and_optimizer_state(tmp_path):
    state, data = _single(), dataset()
    trainer, sampler = build_trainer(state), build_sampler(state)
    train_steps(trainer, sampler, data, 1)
    good = checkpoint_path(tmp_path, 1)
    save_training_checkpoint(good, trainer, sampler_state=sampler.state_dict(), world_group=None, run_id="r")
    assert read_manifest(good)["extra"]["verified_finite"] is True
    before = sorted(os.listdir(tmp_path))

    parameter = next(p for n, p in trainer.model.named_parameters() if "experts" in n)
    with torch.no_grad():
        parameter.view(-1)[3] = float("nan")
    with pytest.raises(CheckpointError, match=r"step 1: parameter 'layers\.1\.mlp\.experts\.0\..*' holds NaN"):
        save_training_checkpoint(good, trainer, sampler_state=None, world_group=None)
    with torch.no_grad():
        parameter.view(-1)[3] = 0.0
    trainer.optimizer.state[parameter]["exp_avg_sq"].view(-1)[0] = float("inf")
    trainer.step = 2
    with pytest.raises(CheckpointError, match=r"step 2: optimizer state 'exp_avg_sq' of parameter 'layers\.1\."):
        save_training_checkpoint(checkpoint_path(tmp_path, 2), trainer, sampler_state=None, world_group=None)
    assert sorted(os.listdir(tmp_path)) == before                    # nothing written, nothing replaced
    assert read_manifest(good)["extra"]["step"] == 1


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


def test_fine_tuned_checkpoint_of_an_import_exports_without_hf_config(tmp_path):
    """import-hf -> train one step -> save with the import's HFProvenance -> export-hf needs no --hf-config,
    writes the original config.json and side files, and transformers loads the trained weights."""
    from safetensors.torch import load_file

    from checkpoint_tools.model_loading import build_model_from_checkpoint
    from megamoe.training.checkpoint import HFProvenance
    from megamoe.training.trainer import TrainConfig, Trainer
    from test_convert import SIDE_FILES, convert, save_hf_model
    from parallel_state import ParallelState

    hf_dir, imported, tuned, exported = (tmp_path / n for n in ("hf", "imported", "tuned", "exported"))
    save_hf_model(hf_dir, "qwen3_moe")
    assert convert("import-hf", hf_dir, imported, "--tp", 1, "--pp", 1, "--ep", 1) == 0
    provenance = HFProvenance.of_checkpoint(imported)
    assert provenance.config == json.loads((hf_dir / "config.json").read_text())
    side_files = {p.name: p.read_bytes() for p in hf_dir.iterdir()
                  if p.name != "config.json" and not p.name.endswith(".safetensors")}
    assert set(SIDE_FILES) < set(side_files) and provenance.files == side_files

    state = ParallelState.single_process()
    model = build_model_from_checkpoint(imported, state)
    reference = build_model_from_checkpoint(imported, state, expert_backend="loop", dispatcher="allgather")
    assert {(layer.experts.backend, layer.config.dispatcher) for layer in reference.moe_layers().values()} == {
        ("loop", "allgather")}
    trainer = Trainer(model, state, TrainConfig(lr=1e-2, weight_decay=0.0))
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reference(ids)[0], model(ids)[0], rtol=1e-5, atol=1e-5)
    trainer.train_step([(ids[:, :-1], ids[:, 1:])])
    save_training_checkpoint(tuned, trainer, sampler_state=None, world_group=None)
    assert convert("export-hf", tuned, exported) != 0             # without provenance: --hf-config needed
    assert not exported.exists()
    save_training_checkpoint(tuned, trainer, sampler_state=None, world_group=None, hf_provenance=provenance)
    assert HFProvenance.of_checkpoint(tuned) == provenance

    assert convert("export-hf", tuned, exported) == 0
    assert json.loads((exported / "config.json").read_text()) == provenance.config
    for name, data in side_files.items():
        assert (exported / name).read_bytes() == data
    weights = load_file(str(exported / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    assert torch.equal(embed, model.embed_tokens.weight.detach())
    assert not torch.equal(embed, load_file(str(hf_dir / "model.safetensors"))["model.embed_tokens.weight"])


def test_extra_files_must_stay_inside_the_checkpoint(tmp_path):
    from checkpoint_tools.format import save_checkpoint

    for bad in ("../escape.json", "/abs/file", "manifest.json", "part.safetensors"):
        with pytest.raises(ValueError, match="relative path inside the checkpoint"):
            save_checkpoint(tmp_path / "ckpt", [], manifest_fields={}, extra_files={bad: b"x"})
    assert not (tmp_path / "ckpt").exists()


def test_pruning_with_a_run_id_leaves_other_saves_in_progress_alone(tmp_path):
    """A ``step_N.tmp-*`` names no run: pruning with a run id deletes only those of the steps it prunes."""
    for step in (10, 20, 30):
        _fake_checkpoint(tmp_path, step, run_id="mine")
    (tmp_path / "step_00000010.tmp-abc").mkdir()       # this run's save of step 10, interrupted
    (tmp_path / "step_00000015.tmp-def").mkdir()       # maybe another run's save, under way
    removed = prune_checkpoints(tmp_path, keep_last=2, run_id="mine")
    assert sorted(os.path.basename(p) for p in removed) == ["step_00000010", "step_00000010.tmp-abc"]
    assert (tmp_path / "step_00000015.tmp-def").is_dir()
