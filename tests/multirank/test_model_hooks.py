"""GPTMoEModel's construction hooks (LayerSpec) and the Trainer's model protocol: a MoELayer subclass with
its own router is built into the model, trained, checkpointed and resumed (2 ranks, EP 2); custom
attention and MLP classes are used; a model missing part of the protocol is refused by name.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_model_hooks.py."""

import pytest
import torch
import torch.distributed as dist

from megamoe.checkpoint.format import read_manifest
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint
from tests.helpers.model_hooks import OFFSET, _batches, _micro_batches, _offset_trainer, _tokens_per_rank


# ----------------------------------------------------------------------------------------------
# End to end: 2 ranks, EP 2
# ----------------------------------------------------------------------------------------------
def _train_save_resume(rank, world_size, directory):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    torch.set_num_threads(1)
    state = initialize_model_parallel(ep=2)                 # DP 2 x EP 2, all-to-all
    batches = _batches(5)
    trainer = _offset_trainer(state, dist.group.WORLD)
    losses, expert0_share = [], []
    for step, batch in enumerate(batches):
        losses.append(trainer.train_step(_micro_batches(batch, state)).loss)
        expert0_share.append([int(layer.load_counter.per_expert[0]) for layer in trainer.model.moe_layers().values()])
        if step == 2:
            save_training_checkpoint(directory, trainer, sampler_state={"next_batch": 3},
                                     world_group=dist.group.WORLD)
    offsets = {i: layer.router.logit_offset.detach().tolist() for i, layer in trainer.model.moe_layers().items()}

    resumed = _offset_trainer(state, dist.group.WORLD)
    extra = load_training_checkpoint(directory, resumed, world_group=dist.group.WORLD)
    resumed_losses = [resumed.train_step(_micro_batches(batch, state)).loss
                      for batch in batches[extra["sampler_state"]["next_batch"]:]]
    resumed_offsets = {i: layer.router.logit_offset.detach().tolist()
                       for i, layer in resumed.model.moe_layers().items()}
    destroy_model_parallel()
    return dict(losses=losses, resumed_losses=resumed_losses, expert0=expert0_share, offsets=offsets,
                resumed_offsets=resumed_offsets, tokens=_tokens_per_rank(state), step=resumed.step)


@pytest.mark.slow
def test_custom_router_in_the_model_trains_saves_and_resumes_on_two_ranks(tmp_path):
    directory = tmp_path / "step_3"
    ranks = run_on_ranks(_train_save_resume, 2, args=(str(directory),), timeout_s=600)
    for result in ranks:
        assert result["step"] == 5
        assert result["resumed_losses"] == result["losses"][3:], "the resumed run continues bitwise"
        assert result["resumed_offsets"] == result["offsets"]
        assert result["expert0"][0] == [result["tokens"]] * 3, "the custom router routed every token to expert 0"
        assert all(offsets[0] != OFFSET for offsets in result["offsets"].values())
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    tensors = read_manifest(directory)["tensors"]
    assert all(f"layers.{i}.mlp.router.logit_offset" in tensors for i in (1, 2, 3))
    assert "optim.exp_avg.layers.1.mlp.router.logit_offset" in tensors
