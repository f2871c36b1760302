"""Training checkpoints: a resumed run continues bitwise (in process, after SIGKILL, after a death in the
middle of a save), optimizer state follows experts into replica slots, step-numbered directories, and a
checkpoint saved under one layout resumes under others on the single-process loss curve."""

import glob
import json
import logging
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from megamoe.checkpoint import checksums, integrity
from megamoe.checkpoint.format import CheckpointError, read_manifest, save_checkpoint
from tests.helpers.checkpointed_training import build_sampler, build_trainer, dataset, train_steps
from megamoe.cli.launch import run_script
from megamoe.checkpoint_state import chunks_by_parameter, optimizer_chunks, sharded_state_dict
from megamoe.models import GPTMoEConfig
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.training.checkpoint import (checkpoint_path, checkpoint_run_id, expert_placements_from_checkpoint,
                                         foreign_checkpoint_differences, last_good_checkpoint, latest_checkpoint,
                                         list_checkpoints, load_training_checkpoint, new_run_id, prune_checkpoints,
                                         resolve_resume_checkpoint, save_training_checkpoint,
                                         verify_resume_checkpoint)
from megamoe.training.checkpoint_health import Health, HealthMonitor
from megamoe.training.save_dir_lock import SaveDirBusyError, lock_save_dir
from megamoe.training.trainer import StepMetrics
from tests.helpers.pretrain_data import TINY as DATA_TINY

from tests.helpers.tiny_model import E, tiny_config
from tests.helpers.training_checkpoint import _assert_close, _single


pytestmark = pytest.mark.usefixtures("one_thread")


def _all_chunks(trainer):
    """Every logical chunk of the trainer's model and optimizer (full tensors in one process)."""
    chunks = sharded_state_dict(trainer.model)
    return chunks + optimizer_chunks(trainer.optimizer, chunks_by_parameter(trainer.model.parameters(), chunks))


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


def test_fine_tuned_checkpoint_of_an_import_exports_without_hf_config(tmp_path):
    """import-hf -> train one step -> save with the import's HFProvenance -> export-hf needs no --hf-config,
    writes the original config.json and side files, and transformers loads the trained weights."""
    from safetensors.torch import load_file

    from megamoe.checkpoint.model_loading import build_model_from_checkpoint
    from megamoe.training.checkpoint import HFProvenance
    from megamoe.training.trainer import TrainConfig, Trainer
    from tests.helpers.hf_checkpoints import SIDE_FILES, convert, save_hf_model
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
    from megamoe.checkpoint.format import save_checkpoint

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


# ----------------------------------------------------------------------------------------------
# Resume choices, health, damage, foreign checkpoints, the save-dir lock (issue 28, parts 5 and 7)
# ----------------------------------------------------------------------------------------------
def _tensor_checkpoint(directory, step, value=1.0, **extra):
    """A checkpoint holding one small tensor (a data file with a checksum) and the given ``extra``."""
    from megamoe.checkpoint_state import LogicalChunk
    chunk = LogicalChunk("w", torch.full((4,), float(value)), (4,), (0,))
    save_checkpoint(checkpoint_path(directory, step), [chunk], manifest_fields={"extra": {"step": step, **extra}})
    return checkpoint_path(directory, step)


def test_resume_location_a_step_folder_or_a_chosen_step(tmp_path):
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    assert resolve_resume_checkpoint(tmp_path) == checkpoint_path(tmp_path, 6)
    assert resolve_resume_checkpoint(tmp_path, 4) == checkpoint_path(tmp_path, 4)
    assert resolve_resume_checkpoint(checkpoint_path(tmp_path, 2)) == checkpoint_path(tmp_path, 2)
    assert resolve_resume_checkpoint(checkpoint_path(tmp_path, 2), 2) == checkpoint_path(tmp_path, 2)
    with pytest.raises(CheckpointError, match="holds no checkpoint of step 5; its steps: 2, 4, 6"):
        resolve_resume_checkpoint(tmp_path, 5)
    with pytest.raises(CheckpointError, match="is the checkpoint of step 2, not of step 4"):
        resolve_resume_checkpoint(checkpoint_path(tmp_path, 2), 4)
    with pytest.raises(CheckpointError, match="no complete checkpoint found there"):
        resolve_resume_checkpoint(tmp_path / "absent")


def test_pruning_never_removes_the_newest_checkpoint_before_the_trouble(tmp_path):
    """A diverged run's saves are finite (weights ~1e30) but suspect: however many follow, the newest
    good checkpoint stays, and it is the one the advice names."""
    for step in (4, 6):
        _fake_checkpoint(tmp_path, step, run_id="r", verified_finite=True,
                         health=Health(3.0, 1.0, 20.0, 0).to_dict())
    for step in (8, 10, 12, 14, 16):
        _fake_checkpoint(tmp_path, step, run_id="r", verified_finite=True,
                         health=Health(float("nan"), float("nan"), 1e31, step - 6, "steps skipped").to_dict())
        prune_checkpoints(tmp_path, keep_last=2, run_id="r")
    assert _steps(tmp_path) == [6, 14, 16]
    assert last_good_checkpoint(tmp_path) == checkpoint_path(tmp_path, 6)
    assert last_good_checkpoint(tmp_path, before_step=6) is None          # step 4 went: it was not the newest


def test_health_compares_each_save_with_the_last_good_checkpoint():
    def step(loss=3.0, grad_norm=1.0, skipped=False, loss_scale=None):
        return StepMetrics(step=0, loss=loss, aux_loss=0.0, grad_norm=grad_norm, tokens_per_s=1.0, balancedness=1.0,
                           skipped=skipped, loss_scale=loss_scale)

    monitor = HealthMonitor()
    monitor.record(step())
    first = monitor.judge(20.0)
    assert first.suspect is None and (first.loss, first.grad_norm, first.skipped_steps) == (3.0, 1.0, 0)
    monitor.saved(first, "good")
    # lr 1e30: one update to weights ~1e30, every later step non-finite: finite weights, yet suspect.
    monitor.record(step(loss=4.0))
    monitor.record(step(loss=float("nan"), grad_norm=float("nan"), skipped=True))
    bad = monitor.judge(1e31)
    assert "1 step(s) skipped" in bad.suspect and "weight norm 1e+31, more than 10x" in bad.suspect
    monitor.saved(bad, "bad")
    assert monitor.reference_path == "good" and "The last good checkpoint is good" in monitor.rollback_advice()
    # Still against the good one: the skips count until a good save.
    monitor.record(step())
    assert "1 step(s) skipped" in monitor.judge(20.0).suspect
    # Each bound on its own, against the good checkpoint's loss 3, grad norm 1, weight norm 20.
    for metrics, weight_norm, reason in ((step(loss=7.5), 20.0, "mean loss 7.5"),
                                        (step(grad_norm=150.0), 20.0, "grad norm 150"),
                                        (step(), float("inf"), "weight norm inf")):
        fresh = HealthMonitor(first, "good")
        fresh.record(metrics)
        assert reason in fresh.judge(weight_norm).suspect
    # fp16: a skip with a finite loss only lowered the loss scale; it does not count.
    fp16 = HealthMonitor(first, "good")
    fp16.record(step(grad_norm=float("inf"), skipped=True, loss_scale=65536.0))
    fp16.record(step(loss=3.2, grad_norm=2.0))
    assert fp16.judge(21.0).suspect is None
    assert Health.from_dict(bad.to_dict()).suspect == bad.suspect and bad.to_dict()["loss"] == 4.0


def test_a_damaged_newest_checkpoint_names_the_previous_intact_one(tmp_path):
    for step in (2, 4, 6):
        _tensor_checkpoint(tmp_path, step, value=step)
    verify_resume_checkpoint(checkpoint_path(tmp_path, 6), world_group=None)

    def damage(step):                         # same size, one byte changed
        data_file, = glob.glob(os.path.join(checkpoint_path(tmp_path, step), "*.safetensors"))
        with open(data_file, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        integrity.forget_verified()

    damage(6)
    damage(4)
    with pytest.raises(CheckpointError, match=r"checksum mismatch .*step_00000006.*; the previous intact checkpoint "
                                              r"is .*step_00000002 \(step 2\).*--load-step 2"):
        verify_resume_checkpoint(checkpoint_path(tmp_path, 6), world_group=None)
    damage(2)
    with pytest.raises(CheckpointError, match="no earlier checkpoint in .* is intact"):
        verify_resume_checkpoint(checkpoint_path(tmp_path, 4), world_group=None)


def test_foreign_checkpoint_differences_name_the_model_fields_and_the_tokenizer(tmp_path):
    config = tiny_config()
    other = config.to_dict()
    other["hidden_size"] = 64
    other["moe"]["dispatcher"] = "allgather"                  # an engine choice: never a difference
    other["moe"]["router"]["aux_loss_coeff"] = 0.5            # a balancing coefficient: neither
    path = checkpoint_path(tmp_path, 1)
    save_checkpoint(path, [], manifest_fields={"model_config": other, "extra": {"step": 1, "hf_files": {
        "tokenizer.model": checksums.bytes_entry(b"old")}}}, extra_files={"hf_files/tokenizer.model": b"old"})
    assert foreign_checkpoint_differences(path, config.to_dict(), {"tokenizer.model": b"old"}) == [
        f"hidden_size 64 -> {config.hidden_size}"]
    differences = foreign_checkpoint_differences(path, other, {"tokenizer.model": b"new"})
    assert len(differences) == 1 and differences[0].startswith("the tokenizer (tokenizer.model in ")
    assert foreign_checkpoint_differences(path, other, None) == []      # this run has no tokenizer to compare


def test_save_dir_lock_refuses_a_second_run_and_takes_over_a_stale_lock(tmp_path, caplog):
    first = lock_save_dir(tmp_path / "ckpt", "run-1")
    with pytest.raises(SaveDirBusyError, match=rf"in use by another training run, run run-1 \(host "
                                               rf"{socket.gethostname()}, pid {os.getpid()}, since"):
        lock_save_dir(tmp_path / "ckpt", "run-2")
    first.release()
    lock_save_dir(tmp_path / "ckpt", "run-3").release()       # released: free again
    # A killed run's lock: the file names its owner, whose pid is gone; nobody holds the flock.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "ckpt" / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout),
                                                         "run_id": "killed", "started": "earlier"}))
    caplog.set_level(logging.INFO, logger="megamoe.training.save_dir_lock")
    taken = lock_save_dir(tmp_path / "ckpt", "run-4")
    assert "taking over the stale lock of run killed" in caplog.text
    assert json.loads((tmp_path / "ckpt" / ".lock").read_text())["run_id"] == "run-4"
    taken.release()


def test_save_dir_lock_without_flock_goes_by_the_recorded_owner(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock_file = tmp_path / ".lock"
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    for host, pid, busy in ((socket.gethostname(), os.getppid(), True), ("another-host", dead, True),
                            (socket.gethostname(), dead, False)):
        lock_file.write_text(json.dumps({"host": host, "pid": pid, "run_id": "other"}))
        if busy:
            with pytest.raises(SaveDirBusyError, match=f"run other \\(host {host}, pid {pid}.*has no flock"):
                lock_save_dir(tmp_path, "mine")
        else:
            lock_save_dir(tmp_path, "mine").release()


# The training script on a tiny model and a token file whose sidecar names its tokenizer.
def _train(demo, capsys, inputs, work, *more):
    root, _ = inputs
    argv = ["--work-dir", work, *DATA_TINY, "--data", root / "c.bin", *more]
    code = run_script(demo.main, [str(a) for a in argv], prog=demo.PROG)
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(code, err, *fragments):
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("pretrain_moe.py: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_script_resumes_a_step_folder_or_a_chosen_step_and_keeps_n(demo, inputs, tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="megamoe.training")
    work = tmp_path / "work"
    ckpt = work / "checkpoints"                                  # the default: under --work-dir
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 3, "--save-every", 1, "--keep-checkpoints", 3)
    assert code == 0, err
    assert _steps(ckpt) == [1, 2, 3]
    # A step folder of the save dir: that step, and its later checkpoints move aside (not pruned, not resumed).
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 3, "--save-every", 1, "--keep-checkpoints", 3,
                          "--load-dir", ckpt / "step_00000002")
    assert code == 0, err
    assert f"resuming from {ckpt / 'step_00000002'} at step 2" in caplog.text
    replaced, = ckpt.glob("replaced_*")
    assert [p.name for p in replaced.iterdir()] == ["step_00000003"] and _steps(ckpt) == [1, 2, 3]
    caplog.clear()
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 2, "--save-every", 1, "--keep-checkpoints", 1,
                          "--load-step", 1)
    assert code == 0, err
    assert f"resuming from {ckpt / 'step_00000001'} at step 1" in caplog.text and _steps(ckpt) == [2]
    assert sorted(p.name for p in ckpt.glob("replaced_*/*")) == ["step_00000002", "step_00000003", "step_00000003"]
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 3, "--load-step", 9)
    _one_error_line(code, err, "--load-step 9", "holds no checkpoint of step 9; its steps: 2")
    code, _, err = _train(demo, capsys, inputs, work, "--keep-checkpoints", 0)
    _one_error_line(code, err, "--keep-checkpoints must be >= 1")


def _same_size_other_tokenizer(source, target):
    """``source``'s WordLevel tokenizer with two words' ids swapped: the same vocabulary size, other ids."""
    data = json.loads((source / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(word for word in vocab if not word.startswith("<") and word != "</s>")[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    target.mkdir()
    (target / "tokenizer.json").write_text(json.dumps(data))
    shutil.copy(source / "tokenizer_config.json", target)


def test_script_refuses_a_checkpoint_of_another_model_or_tokenizer(demo, inputs, tmp_path, capsys):
    root, _ = inputs
    work = tmp_path / "work"
    documents = ["--data", root / "a.jsonl", "--text-field", "body"]     # (the last --data wins)
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 1, *documents, "--tokenizer", root / "tok")
    assert code == 0, err
    _same_size_other_tokenizer(root / "tok", tmp_path / "tok2")
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 2, *documents, "--tokenizer", tmp_path / "tok2")
    _one_error_line(code, err, "step_00000001 was saved with another model or tokenizer than this run's",
                    "the tokenizer (tokenizer.json in", "--allow-foreign-checkpoint")
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 2, "--hidden", 32)
    _one_error_line(code, err, "hidden_size 16 -> 32")
    assert _steps(work / "checkpoints") == [1]
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 2, *documents, "--tokenizer", tmp_path / "tok2",
                          "--allow-foreign-checkpoint")
    assert code == 0, err
    assert _steps(work / "checkpoints") == [1, 2]


def test_a_diverged_run_keeps_the_last_good_checkpoint_and_names_it(demo, inputs, tmp_path, capsys):
    """Resumed with --lr 1e30: one update to weights ~1e30, then every step is skipped. Its saves are
    marked suspect, the newest good checkpoint survives pruning, and the final error names it."""
    work = tmp_path / "work"
    ckpt = work / "checkpoints"
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 2, "--save-every", 1)
    assert code == 0, err
    good = read_manifest(ckpt / "step_00000002")["extra"]["health"]
    assert good["suspect"] is None and good["skipped_steps"] == 0 and good["weight_norm"] > 0
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 16, "--save-every", 1, "--lr", 1e30,
                          "--override-opt-param-scheduler", "--max-skipped-steps", 2)
    line = _one_error_line(code, err, "training stopped at step", "consecutive steps were non-finite",
                           f"The last good checkpoint is {ckpt / 'step_00000002'}")
    stopped = int(line.split("training stopped at step ")[1].split(":")[0])
    saved = _steps(ckpt)            # step 1 pruned (keep 2), step 2 kept: the newest good one
    assert saved == [2, stopped - 2, stopped - 1] and stopped > 4, saved
    for step in saved[1:]:
        health = read_manifest(checkpoint_path(ckpt, step))["extra"]["health"]
        assert health["suspect"] and read_manifest(checkpoint_path(ckpt, step))["extra"]["verified_finite"], health
    assert last_good_checkpoint(ckpt) == checkpoint_path(ckpt, 2)


def test_a_second_run_into_a_locked_save_dir_is_refused(demo, inputs, tmp_path, capsys):
    work = tmp_path / "work"
    held = lock_save_dir(work / "checkpoints", "the-first-run")
    try:
        code, _, err = _train(demo, capsys, inputs, work, "--steps", 2)
        _one_error_line(code, err, f"--save-dir {work / 'checkpoints'} is in use by another training run, run "
                                   f"the-first-run (host {socket.gethostname()}, pid {os.getpid()}")
        assert _steps(work / "checkpoints") == []
    finally:
        held.release()
    code, _, err = _train(demo, capsys, inputs, work, "--steps", 2)
    assert code == 0, err
