"""Pipeline parallelism.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_pipeline.py."""

import pytest
import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.pipeline import forward_backward, forward_backward_1f1b, partition_layers
from megamoe.spawned_ranks import run_on_ranks
from parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.pipeline import (HIDDEN, MICRO_BATCH, NUM_LAYERS, SEQ, SHAPE, _StageStep, _check_grads, _close,
                                    _layers, _reference)


# ----------------------------------------------------------------------------------------------
# Several ranks
# ----------------------------------------------------------------------------------------------
def _check_pipeline(pp_group, split, replica, num_micro_batches, state=None):
    """Run this rank's stage of a pipeline over ``pp_group`` and compare with the whole model."""
    ranks = comms.group_ranks(pp_group)
    pp_size, pp_rank = len(ranks), comms.group_rank(pp_group)
    prev_rank = ranks[pp_rank - 1] if pp_rank > 0 else None
    next_rank = ranks[pp_rank + 1] if pp_rank < pp_size - 1 else None
    what = f"pp={pp_size} split={split} stage={pp_rank} replica={replica} micro-batches={num_micro_batches}"
    stage_range = partition_layers(NUM_LAYERS, pp_size, split)[pp_rank]
    layers = _layers()
    step = _StageStep(layers, stage_range, pp_rank == 0, pp_rank == pp_size - 1, replica, num_micro_batches)
    with comms.comm_counter() as counter:
        if state is not None:
            losses = forward_backward(step, num_micro_batches, state, SHAPE, torch.float32)
        else:
            losses = forward_backward_1f1b(
                step, num_micro_batches, pp_group=pp_group, pp_rank=pp_rank, pp_size=pp_size, prev_rank=prev_rank,
                next_rank=next_rank, tensor_shape=SHAPE, dtype=torch.float32)

    ref_losses, ref_layers = _reference(replica, num_micro_batches)
    if next_rank is None:
        assert len(losses) == num_micro_batches, what
        for index, (loss, ref) in enumerate(zip(losses, ref_losses)):
            _close(loss, ref, f"{what}: loss of micro-batch {index}")
    else:
        assert losses == [], what
    _check_grads(layers, ref_layers, stage_range, what)

    # Per micro-batch and neighbour: one send and one receive (activation one way, gradient the other).
    neighbours = (prev_rank is not None) + (next_rank is not None)
    transfers = num_micro_batches * neighbours
    nbytes = transfers * MICRO_BATCH * SEQ * HIDDEN * 4
    assert counter.kinds() == {"send": transfers, "recv": transfers}, (what, counter.kinds())
    assert counter.calls(group=ranks) == 2 * transfers, what
    assert counter.bytes("send") == nbytes and counter.bytes("recv") == nbytes, what
    # 1F1B's memory bound, reached exactly: warmup forwards plus the one of the steady state.
    assert step.max_alive == min(pp_size - pp_rank, num_micro_batches), (what, step.max_alive)
    return what


def _pipeline_worker(rank, world_size):
    done = []
    # PP=4 through a ParallelState (forward_backward picks 1F1B), even split.
    state = initialize_model_parallel(pp=4)
    assert state.pp.ranks == (0, 1, 2, 3)
    done.append(_check_pipeline(state.pp.group, None, 0, 6, state=state))
    destroy_model_parallel()

    world = dist.group.WORLD
    done.append(_check_pipeline(world, [3, 1, 0, 4], 0, 6))    # custom split with an empty stage
    done.append(_check_pipeline(world, None, 0, 2))            # fewer micro-batches than stages

    # PP=2 x DP=2: pipelines {0, 2} and {1, 3} (stage = rank // 2), each replica its own data and split;
    # neighbours are global ranks that differ from the group ranks.
    pipelines = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica = rank % 2
    done.append(_check_pipeline(pipelines[replica], [None, [6, 2]][replica], replica, 6))

    # Errors are raised before any message is posted, so one rank can hit them alone.
    if rank == 0:
        def wrong_shape(input_tensor, index):
            return torch.zeros(MICRO_BATCH, SEQ, HIDDEN + 1)
        with pytest.raises(ValueError, match="tensor_shape"):
            forward_backward_1f1b(wrong_shape, 2, pp_group=world, pp_rank=0, pp_size=4, prev_rank=None,
                                  next_rank=1, tensor_shape=SHAPE, dtype=torch.float32)
    with pytest.raises(ValueError, match="neighbours"):
        forward_backward_1f1b(lambda x, i: x, 2, pp_group=pipelines[replica], pp_rank=rank // 2, pp_size=2,
                              prev_rank=None if rank < 2 else rank - 1, next_rank=rank + 1 if rank < 2 else None,
                              tensor_shape=SHAPE, dtype=torch.float32)
    return done


@pytest.mark.slow
def test_pipeline_matches_single_process_pp2_pp4():
    results = run_on_ranks(_pipeline_worker, 4)
    assert all(len(done) == 4 for done in results), results
    assert results[2][3].startswith("pp=2 split=None stage=1 replica=0")
