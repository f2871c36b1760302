"""Measured memory (megamoe.training.memory_measure) and the closed-form estimate (memory_estimate).

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_memory.py."""

from __future__ import annotations

import pytest

from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.memory_estimate import estimate_memory
from megamoe.training.memory_measure import measure_train_step
from megamoe.training.trainer import TrainConfig, Trainer
from tests.helpers.memory import MICRO, SEQ, _batches, qwen3_like

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- two ranks ----------------------------------------------------------------------------------------
TWO_RANK_RUNS = [  # (layout, TrainConfig keywords)
    (dict(), dict(distributed_optimizer=True)),                   # DP 2, ZeRO-1
    (dict(), dict(distributed_optimizer=True, zero_stage=2)),     # DP 2, ZeRO-2: gradient shards only
    (dict(ep=2), dict()),                                         # EP 2 (all-to-all), plain AdamW
    (dict(pp=2), dict(distributed_optimizer=True)),               # PP 2, 1F1B over two micro-batches
    (dict(cp=2), dict()),                                         # CP 2: keys gathered over the sequence
]


def _two_rank_worker(rank, world_size):
    import torch.distributed as dist

    from parallel_state import destroy_model_parallel, initialize_model_parallel
    out = []
    for layout, train in TWO_RANK_RUNS:
        state = initialize_model_parallel(**layout)
        model = GPTMoEModel(qwen3_like(), state)
        initialize_parameters(model, seed=0)
        trainer = Trainer(model, state, TrainConfig(lr=1e-3, **train), world_group=dist.group.WORLD)
        # two micro-batches of one sequence each
        steps = [[(inputs[j:j + 1], labels[j:j + 1]) for j in range(MICRO)] for ((inputs, labels),) in _batches()]
        trainer.train_step(steps[0])
        memory, _ = measure_train_step(trainer, steps[1])
        s = memory.state
        out.append((state.pp.rank, s.param_bytes, s.grad_bytes, s.optimizer_bytes, memory.saved_activation_bytes))
        destroy_model_parallel()
    return out


@pytest.mark.slow      # ~10-20 s: one spawn of 2 gloo ranks, four layouts
def test_estimate_matches_the_measurement_on_two_ranks():
    from megamoe.spawned_ranks import run_on_ranks
    per_rank = run_on_ranks(_two_rank_worker, 2)
    for i, (layout, train) in enumerate(TWO_RANK_RUNS):
        pp, ep, cp = layout.get("pp", 1), layout.get("ep", 1), layout.get("cp", 1)
        estimate = estimate_memory(qwen3_like(), pp=pp, ep=ep, cp=cp, dp=2 // (pp * cp), micro_batch=1, seq_len=SEQ,
                                   num_micro_batches=2, distributed_optimizer=train.get("distributed_optimizer", False),
                                   zero_stage=train.get("zero_stage", 1))
        for rank in range(2):
            stage_id, params, grads, optimizer, activations = per_rank[rank][i]
            stage = estimate.stages[stage_id]
            assert (params, grads, optimizer) == (stage.param_bytes, stage.grad_bytes, stage.optimizer_bytes), (
                layout, train, rank)
            assert activations == pytest.approx(stage.activation_bytes, rel=0.10), (layout, train, rank)
