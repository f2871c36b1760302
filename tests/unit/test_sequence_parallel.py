"""Sequence parallelism in the model (megamoe.models.sequence_parallel).

The in-process cases; those that spawn ranks or run scripts end to end are in
tests/multirank/test_sequence_parallel.py."""

import dataclasses

import pytest
import torch

from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from tests.helpers.sequence_parallel import batch, config, gqa, mla

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------
# Single process: config, checkpoint engine field
# ----------------------------------------------------------------------------------------------
def test_config_round_trip_and_validation():
    cfg = config(gqa(), "allgather", sp=True)
    assert GPTMoEConfig.from_dict(cfg.to_dict()).sequence_parallel is True
    assert GPTMoEConfig.from_dict(config(mla(12), "alltoall").to_dict()).sequence_parallel is False
    with pytest.raises(ValueError, match="sequence_parallel"):
        dataclasses.replace(cfg, sequence_parallel="yes")
    from megamoe.training.checkpoint import _ENGINE_FIELDS
    assert "sequence_parallel" in _ENGINE_FIELDS
    from megamoe.checkpoint.model_loading import config_for_engine     # generation loads checkpoints without SP
    assert config_for_engine(cfg, sequence_parallel=False).sequence_parallel is False
    assert config_for_engine(cfg).sequence_parallel is True


def test_one_rank_ignores_sequence_parallel():
    """tp = 1: nothing to split; the model is the plain one (a checkpoint resumes there)."""
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    inputs, labels, position_ids, document_ids = batch()
    losses = []
    for sp in (False, True):
        model = GPTMoEModel(config(gqa(), "allgather", sp=sp), state)
        initialize_parameters(model, seed=0)
        loss, _ = model(inputs, labels=labels, position_ids=position_ids, document_ids=document_ids)
        losses.append(loss)
        assert not any(getattr(p, "sequence_parallel", False) for p in model.parameters())
    assert torch.equal(*losses)


# ----------------------------------------------------------------------------------------------
# The script's flag
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, world, fragments", [
    (["--sequence-parallel"], None, ["--sequence-parallel", "needs --tp > 1", "--tp 1"]),
    (["--sequence-parallel", "--tp", "2", "--seq-len", "63"], "2", ["--seq-len 63", "divisible by --tp 2"]),
])
def test_script_refuses_bad_sequence_parallel_flags(demo, extra, world, fragments, tmp_path, capsys, monkeypatch):
    from megamoe.cli.launch import run_script
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    argv = ["--work-dir", tmp_path / "work", "--save-dir", tmp_path / "ckpt", *extra]
    code = run_script(demo.main, [str(a) for a in argv], prog=demo.PROG)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("pretrain_moe.py: error: "), err
    assert all(f in lines[0] for f in fragments), lines[0]
    assert not out and not (tmp_path / "work").exists()


def test_checkpoint_resumes_with_the_other_sequence_parallel_choice(tmp_path, caplog):
    """An engine field: a run saved with sequence parallelism resumes without it (and the reverse)."""
    from parallel_state import ParallelState
    from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint
    from megamoe.training.trainer import TrainConfig, Trainer
    state = ParallelState.single_process()
    inputs, labels, _, _ = batch()
    trainers = []
    for sp in (True, False):
        model = GPTMoEModel(config(gqa(), "allgather", sp=sp, shared=False), state)
        initialize_parameters(model, seed=sp)         # different weights: the load must overwrite them
        trainers.append(Trainer(model, state, TrainConfig(lr=1e-2)))
    saved, resumed = trainers
    saved.train_step([(inputs, labels)])
    save_training_checkpoint(tmp_path / "ckpt", saved, sampler_state=None, world_group=None)
    with caplog.at_level("WARNING"):
        load_training_checkpoint(tmp_path / "ckpt", resumed, world_group=None)
    assert "another model config" not in caplog.text     # sequence_parallel is an engine field
    assert resumed.model.config.sequence_parallel is False and resumed.step == 1
    assert saved.train_step([(inputs, labels)]).loss == resumed.train_step([(inputs, labels)]).loss
