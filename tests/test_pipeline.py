"""Pipeline parallelism: layer partition, and the 1F1B schedule against the single-process model.

A toy 8-layer model (Linear + tanh, an MSE loss on the last stage, a per-layer auxiliary loss like an
MoE load-balancing loss) is split over PP=2 and PP=4 stages, evenly and with custom splits, and must
give the same per-micro-batch losses and parameter gradients as one process running it whole. The
communication counter pins the exact number of sends/receives, and weak references to the stage
outputs pin 1F1B's memory bound (micro-batches alive at once).
"""

import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megamoe import comms
from megamoe.pipeline import (forward_backward, forward_backward_1f1b, forward_backward_no_pipelining,
                              partition_layers, stage_hidden_dtype)
from megamoe.spawned_ranks import run_on_ranks
from parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel

NUM_LAYERS, MICRO_BATCH, SEQ, HIDDEN = 8, 2, 3, 8
SHAPE = (MICRO_BATCH, SEQ, HIDDEN)
AUX_COEF = 0.01


# ----------------------------------------------------------------------------------------------
# partition_layers
# ----------------------------------------------------------------------------------------------
def test_partition_even_gives_the_remainder_to_the_first_stages():
    assert partition_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert partition_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert partition_layers(5, 1) == [range(0, 5)]
    assert partition_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]


def test_partition_custom_split_allows_explicit_empty_stages():
    assert partition_layers(8, 4, split=[3, 1, 0, 4]) == [range(0, 3), range(3, 4), range(4, 4), range(4, 8)]
    assert partition_layers(8, 2, split=(6, 2)) == [range(0, 6), range(6, 8)]


@pytest.mark.parametrize("num_layers, pp_size, split, message", [
    (3, 4, None, "leaves a stage without layers"),
    (8, 0, None, "pp_size must be >= 1"),
    (-1, 2, None, "num_layers must be >= 0"),
    (8, 2, [4, 4, 0], "3 entries but pp_size is 2"),
    (8, 2, [5, 4], "sums to 9 but num_layers is 8"),
    (8, 2, [9, -1], "integers >= 0"),
    (8, 2, [4.0, 4], "integers >= 0"),
])
def test_partition_errors_name_the_problem(num_layers, pp_size, split, message):
    with pytest.raises(ValueError, match=message):
        partition_layers(num_layers, pp_size, split=split)


# ----------------------------------------------------------------------------------------------
# The toy model, its single-process reference and one pipeline stage of it
# ----------------------------------------------------------------------------------------------
def _layers(seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(NUM_LAYERS))


def _micro_batch(replica, index):
    g = torch.Generator().manual_seed(1000 * replica + index)
    return torch.randn(*SHAPE, generator=g), torch.randn(*SHAPE, generator=g)


def _run_layers(layers, hidden):
    """Apply the layers; the aux loss is summed over them (None without layers, like a layer-less stage)."""
    aux = None
    for layer in layers:
        hidden = torch.tanh(layer(hidden))
        term = AUX_COEF * hidden.pow(2).mean()
        aux = term if aux is None else aux + term
    return hidden, aux


def _reference(replica, num_micro_batches):
    """The whole model in one process, written without the schedules: losses and gradients."""
    layers = _layers()
    losses, total = [], 0.0
    for index in range(num_micro_batches):
        x, target = _micro_batch(replica, index)
        hidden, aux = _run_layers(layers, x)
        loss = F.mse_loss(hidden, target) / num_micro_batches
        losses.append(loss.detach())
        total = total + loss + aux / num_micro_batches
    total.backward()
    return losses, layers


class _StageStep:
    """forward_step of one stage (layers ``stage_range``), remembering how many outputs are alive."""

    def __init__(self, layers, stage_range, is_first, is_last, replica, num_micro_batches):
        self.layers = [layers[i] for i in stage_range]
        self.is_first, self.is_last = is_first, is_last
        self.replica, self.num_micro_batches = replica, num_micro_batches
        self.outputs: list[weakref.ref] = []
        self.max_alive = 0

    def __call__(self, input_tensor, index):
        x, target = _micro_batch(self.replica, index)
        assert (input_tensor is None) == self.is_first
        if input_tensor is not None:
            assert input_tensor.requires_grad and tuple(input_tensor.shape) == SHAPE
        hidden, aux = _run_layers(self.layers, x if self.is_first else input_tensor)
        # The caller scales: losses are per-micro-batch terms of the batch mean (see the schedule docs).
        output = F.mse_loss(hidden, target) / self.num_micro_batches if self.is_last else hidden
        self.outputs.append(weakref.ref(output))
        self.max_alive = max(self.max_alive, sum(ref() is not None for ref in self.outputs))
        return output, (None if aux is None else aux / self.num_micro_batches)


def _close(actual, expected, what):
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-7), \
        f"{what}: max diff {(actual - expected).abs().max().item():.3e}"


def _check_grads(layers, reference_layers, indices, what):
    for i in indices:
        for name in ("weight", "bias"):
            _close(getattr(layers[i], name).grad, getattr(reference_layers[i], name).grad,
                   f"{what}: layer {i} {name} grad")
    for i in set(range(NUM_LAYERS)) - set(indices):
        assert layers[i].weight.grad is None, f"{what}: layer {i} is not on this stage but got a gradient"


# ----------------------------------------------------------------------------------------------
# Single process
# ----------------------------------------------------------------------------------------------
def test_single_stage_schedules_match_the_reference():
    num_micro_batches = 4
    ref_losses, ref_layers = _reference(0, num_micro_batches)
    runs = {
        "no_pipelining": lambda step: forward_backward_no_pipelining(step, num_micro_batches),
        "1f1b_pp1": lambda step: forward_backward_1f1b(
            step, num_micro_batches, pp_group=None, pp_rank=0, pp_size=1, prev_rank=None, next_rank=None,
            tensor_shape=SHAPE, dtype=torch.float32),
        "forward_backward": lambda step: forward_backward(
            step, num_micro_batches, ParallelState.single_process(), SHAPE, torch.float32),
    }
    for what, run in runs.items():
        layers = _layers()
        step = _StageStep(layers, range(NUM_LAYERS), True, True, 0, num_micro_batches)
        with comms.comm_counter() as counter:
            losses = run(step)
        assert counter.calls() == 0, what
        assert len(losses) == num_micro_batches and not any(loss.requires_grad for loss in losses)
        for index, (loss, ref) in enumerate(zip(losses, ref_losses)):
            _close(loss, ref, f"{what}: loss of micro-batch {index}")
        _check_grads(layers, ref_layers, range(NUM_LAYERS), what)
        assert step.max_alive == 1, f"{what}: a micro-batch outlived its backward"


def test_schedule_errors_name_the_problem():
    def loss_step(input_tensor, index):
        return torch.ones(2, requires_grad=True)

    with pytest.raises(ValueError, match="num_micro_batches must be >= 1"):
        forward_backward_no_pipelining(loss_step, 0)
    with pytest.raises(ValueError, match="must return the scalar loss"):
        forward_backward_no_pipelining(loss_step, 1)
    with pytest.raises(ValueError, match="3-tuple"):
        forward_backward_no_pipelining(lambda x, i: (torch.ones(()), None, None), 1)
    with pytest.raises(ValueError, match="aux_loss must be a scalar"):
        forward_backward_no_pipelining(lambda x, i: (torch.ones(()), torch.ones(3)), 1)
    with pytest.raises(ValueError, match="pp_group has 1 rank"):
        forward_backward_1f1b(loss_step, 2, pp_group=None, pp_rank=0, pp_size=2, prev_rank=None, next_rank=1,
                              tensor_shape=SHAPE, dtype=torch.float32)
    with pytest.raises(ValueError, match="pp_rank must be in"):
        forward_backward_1f1b(loss_step, 2, pp_group=None, pp_rank=1, pp_size=1, prev_rank=None, next_rank=None,
                              tensor_shape=SHAPE, dtype=torch.float32)


def test_stage_hidden_dtype_is_the_parameters_whatever_kept_fp8_weights():
    """The hidden states between stages are in the parameters' dtype (autocast aside); kept fp8 weights and
    integer parameters hold no activations."""
    stage = nn.Sequential(nn.Linear(4, 4).to(torch.float8_e4m3fn), nn.Linear(4, 4).to(torch.bfloat16))
    assert stage_hidden_dtype(stage) == torch.bfloat16
    assert stage_hidden_dtype(nn.Linear(4, 4)) == torch.float32
    counter = nn.Module()
    counter.count = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ValueError, match="no floating-point parameter of 16 bits or more"):
        stage_hidden_dtype(counter)


def test_batch_send_recv_without_a_group():
    assert comms.batch_send_recv([], [], None) == []
    with pytest.raises(ValueError, match="no peer"):
        comms.batch_send_recv([(torch.ones(2), 1)], [], None)


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
