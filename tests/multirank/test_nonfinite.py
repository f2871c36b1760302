"""Non-finite steps are skipped on every rank, leave the model untouched and name what went non-finite;
too many in a row stop the run; fp16 dynamic loss scaling backs off and grows, trains like fp32, and is
saved in training checkpoints with the skip counters.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_nonfinite.py."""

import logging

import pytest
import torch.distributed as dist

from tests.helpers.checkpointed_training import build_trainer
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training.trainer import TrainConfig
from tests.helpers.nonfinite import LOGGER, _assert_unchanged, _micro_batches, _poison, _snapshot


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------
# Two ranks: the decision is global
# ----------------------------------------------------------------------------------------------
def _two_rank_worker(rank, world_size):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger(LOGGER).addHandler(Keep(level=logging.WARNING))
    results = []
    state = initialize_model_parallel(tp=2, pp=1, ep=2, etp=1)
    trainer = build_trainer(state, "allgather", world_group=dist.group.WORLD,
                            config=TrainConfig(lr=1e-2, max_skipped_steps=0))
    trainer.train_step(_micro_batches())
    # 1. A gradient made non-finite on rank 1 only: of a TP-sharded weight, which no reduction carries to
    #    rank 0, whose own gradients stay finite.
    name = "layers.2.self_attn.o_proj.weight"
    if rank == 1:
        handle = dict(trainer.model.named_parameters())[name].register_hook(lambda g: g * float("inf"))
    snapshot = _snapshot(trainer)
    m = trainer.train_step(_micro_batches())
    _assert_unchanged(trainer, snapshot)
    results.append((m.skipped, m.step, m.consecutive_skips))
    if rank == 1:
        handle.remove()
    # 2. A weight poisoned on rank 1 only: one of its experts (expert parallel).
    expert_weight = "layers.1.mlp.experts.w_down"
    if rank == 1:
        _poison(trainer.model, expert_weight)
    snapshot = _snapshot(trainer)
    m = trainer.train_step(_micro_batches())
    _assert_unchanged(trainer, snapshot)
    results.append((m.skipped, m.step, m.consecutive_skips))
    destroy_model_parallel()
    # 3. Two pipeline stages, the forward made non-finite in the second: found by re-running micro-batch 0
    #    through the pipeline.
    state = initialize_model_parallel(tp=1, pp=2, ep=1, etp=1)
    trainer = build_trainer(state, world_group=dist.group.WORLD, config=TrainConfig(lr=1e-2, max_skipped_steps=0))
    if rank == 1:
        module = dict(trainer.model.named_modules())["layers.3.input_layernorm"]
        module.register_forward_hook(lambda mod, inputs, out: out * float("nan"))
    m = trainer.train_step(_micro_batches())
    results.append((m.skipped, m.step, m.consecutive_skips))
    destroy_model_parallel()
    return results, messages


@pytest.mark.slow
def test_a_non_finite_step_on_one_rank_is_skipped_on_every_rank():
    per_rank = run_on_ranks(_two_rank_worker, 2, timeout_s=600)
    for results, messages in per_rank:
        assert results == [(True, 2, 1), (True, 3, 2), (True, 1, 1)]
        assert "the gradient of parameter 'layers.2.self_attn.o_proj.weight' went non-finite first in the " \
               "backward (rank 1)" in messages[0]
        assert "parameter 'layers.1.mlp.experts.w_down' holds NaN or Inf (rank 1)" in messages[1]
        assert "the output of module 'layers.3.input_layernorm' went non-finite first in the forward (rank 1)" \
               in messages[2]
