"""Shared by tests/unit/test_nonfinite.py and tests/multirank/test_nonfinite.py: the builders and constants of the
nonfinite tests."""

import torch

from tests.helpers.tiny_model import MICRO_BATCH, global_batches

LOGGER = "megamoe.training.trainer"


def _micro_batches():
    """The whole global batch (one process, or TP ranks without DP)."""
    return [(mb[:, :-1], mb[:, 1:]) for mb in global_batches()[0].split(MICRO_BATCH)]


def _snapshot(trainer):
    """Copies of everything a step may change: parameters, buffers (expert biases), optimizer state."""
    model = trainer.model
    optim = {(i, k): v.clone() for i, p in enumerate(model.parameters())
             for k, v in trainer.optimizer.state.get(p, {}).items() if torch.is_tensor(v)}
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()}, optim)


def _assert_unchanged(trainer, snapshot):
    params, buffers, optim = snapshot
    now = _snapshot(trainer)
    for before, after in zip((params, buffers, optim), now):
        assert before.keys() == after.keys()
        for k in before:
            assert torch.equal(before[k], after[k]), k


def _poison(model, name):
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[0] = float("inf")
