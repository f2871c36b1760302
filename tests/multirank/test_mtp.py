"""DeepSeek-V3 multi-token prediction (megamoe.models.mtp): HF checkpoints with MTP layers (built here: transformers
saves none) import and export bit-exact under tp2 / pp2 / ep2, the main logits stay transformers', the MTP forward,
loss and gradients equal a plain-torch reference of the formula, and a training step under tp2 / pp2 / ep2 equals
one process.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_mtp.py."""

import math

import pytest
import torch

from megamoe.hf.adapters import adapter_for
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.data.packing import MicroBatch
from megamoe.models import GPTMoEModel
from megamoe.models.hf_loading import gather_logical_state, load_logical_state
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training import TrainConfig, Trainer
from parallel_state import ParallelState
from tests.helpers.mtp import _config, _ids, _labels, hf_tensors

# The spawned ranks import this module for their worker: what only this process runs (conversion CLI, generation,
# whose torch.compile pulls in inductor) is imported where it is used.

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------
# A training step under tp2 / pp2 / ep2 equals one process (one 4-rank spawn)
# ----------------------------------------------------------------------------------------------
TRAIN_LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "ep2": dict(ep=2)}


def _micro_batches(ids, rows):
    labels = _labels(ids)
    return [MicroBatch(ids[r:r + 1], labels[r:r + 1]) for r in rows]


def _train_step(model, state, batches, world_group=None):
    trainer = Trainer(model, state, TrainConfig(lr=1.0, grad_clip=0.0), world_group=world_group,
                      optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    return trainer.train_step(batches).loss


def _train_worker(rank, world_size, config, logical, ids, expected, expected_loss):
    import torch.distributed as dist
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    results = []
    for name, sizes in TRAIN_LAYOUTS.items():
        state = initialize_model_parallel(**sizes)
        model = GPTMoEModel(config, state)
        load_logical_state(model, logical)
        dp = state.dp.size
        rows = [r for r in range(ids.shape[0]) if r % dp == state.dp.rank]
        loss = _train_step(model, state, _micro_batches(ids, rows), dist.group.WORLD)
        worst = 0.0
        for chunk in sharded_state_dict(model):
            region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))
            worst = max(worst, (chunk.tensor - expected[chunk.name][region]).abs().max().item())
        results.append((name, abs(loss - expected_loss), worst))
        destroy_model_parallel()
    return results


@pytest.mark.slow
def test_training_step_under_parallel_layouts(mtp_hf_dir):
    config = _config(mtp_hf_dir, expert_backend="torch")
    logical = adapter_for("deepseek_v3").hf_to_megamoe(hf_tensors(mtp_hf_dir), config)
    ids = _ids(4, seed=3)[:, :8]       # MoE folding under tp2 splits the training sequence over TP
    model = GPTMoEModel(config, ParallelState.single_process())
    load_logical_state(model, logical)
    expected_loss = _train_step(model, ParallelState.single_process(), _micro_batches(ids, range(4)))
    expected = gather_logical_state(model)
    moved = {n for n in ("embed_tokens.weight", "lm_head.weight", "layers.3.eh_proj.weight", "layers.4.enorm.weight")
             if not torch.equal(expected[n], logical[n])}
    assert len(moved) == 4, "the step must train the MTP layers and the shared embedding / head"
    assert math.isfinite(expected_loss)
    checked = set()
    for per_rank in run_on_ranks(_train_worker, 4, args=(config, logical, ids, expected, expected_loss)):
        for name, loss_diff, worst in per_rank:
            assert loss_diff <= 1e-5, f"{name}: loss differs by {loss_diff:.2e}"
            assert worst <= 1e-5, f"{name}: parameters after the step differ by up to {worst:.2e}"
            checked.add(name)
    assert checked == set(TRAIN_LAYOUTS)
