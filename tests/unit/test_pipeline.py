"""Pipeline parallelism: layer partition, and the 1F1B schedule against the single-process model.

A toy 8-layer model (Linear + tanh, an MSE loss on the last stage, a per-layer auxiliary loss like an
MoE load-balancing loss) is split over PP=2 and PP=4 stages, evenly and with custom splits, and must
give the same per-micro-batch losses and parameter gradients as one process running it whole. The
communication counter pins the exact number of sends/receives, and weak references to the stage
outputs pin 1F1B's memory bound (micro-batches alive at once).
"""

import pytest
import torch
from torch import nn

from megamoe import comms
from megamoe.pipeline import (forward_backward, forward_backward_1f1b, forward_backward_no_pipelining,
                              partition_layers, stage_hidden_dtype)
from parallel_state import ParallelState
from tests.helpers.pipeline import NUM_LAYERS, SHAPE, _StageStep, _check_grads, _close, _layers, _reference


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
