"""Shared by tests/unit/test_pipeline.py and tests/multirank/test_pipeline.py: the builders and constants of the
pipeline tests."""

import weakref

import torch
import torch.nn.functional as F
from torch import nn


NUM_LAYERS, MICRO_BATCH, SEQ, HIDDEN = 8, 2, 3, 8
SHAPE = (MICRO_BATCH, SEQ, HIDDEN)
AUX_COEF = 0.01


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
