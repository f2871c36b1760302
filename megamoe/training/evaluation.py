"""Held-out loss: forward-only passes over evaluation micro-batches, through the pipeline.

The reported number follows the training loss's convention (:mod:`megamoe.training.trainer`): each
micro-batch's loss is the mean over its tokens, and the evaluation loss is the mean over all
micro-batches of all DP ranks, so it does not depend on the layout when every DP rank holds the
same number of equally sized micro-batches (what :func:`megamoe.data.eval_micro_batches` yields).

Evaluation runs in ``model.eval()`` under ``torch.no_grad``; the MoE layers' load counters see
the evaluation tokens, but the trainer resets them at the start of every step, so evaluation never
feeds the expert-bias update or the load statistics of a training step.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from megamoe import comms
from megamoe.data.packing import MicroBatch
from megamoe.pipeline.schedule import forward_only
from megamoe.precision import upcast

__all__ = ["evaluate_loss"]


@torch.no_grad()
def evaluate_loss(model, state, micro_batches: Sequence, *, world_group=None,
                  autocast_dtype: torch.dtype | None = None) -> float:
    """Mean token loss of ``micro_batches`` (this DP rank's (inputs [mb, S], labels [mb, S]) pairs, or
    :class:`~megamoe.data.packing.MicroBatch` objects), identical on every rank; one all-reduce over ``world_group``."""
    if not micro_batches:
        raise ValueError("evaluate_loss needs at least one micro-batch on every rank")
    device = next(model.parameters()).device
    autocast = (torch.autocast(device_type=device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    mb, seq = MicroBatch(*micro_batches[0]).inputs.shape

    def forward_step(input_tensor, index):
        batch = MicroBatch(*micro_batches[index])
        with autocast:
            out, _ = model(batch.inputs if model.is_first_stage else input_tensor,
                           labels=batch.labels if model.is_last_stage else None, **batch.packing_keywords())
        return upcast(out) if model.is_last_stage else out

    was_training = model.training
    model.eval()
    try:
        hidden_dtype = autocast_dtype or next(model.parameters()).dtype
        losses = forward_only(forward_step, len(micro_batches), state, (mb, seq, model.config.hidden_size),
                              hidden_dtype, device)
    finally:
        model.train(was_training)
    # The loss lives on the last stage, identical over TP and CP: one reporter per DP replica.
    reporter = model.is_last_stage and state.tp.rank == 0 and state.cp.rank == 0
    local = torch.stack(losses).double().mean() if reporter else torch.zeros((), dtype=torch.float64, device=device)
    total = local.reshape(1).to(device=device, dtype=torch.float64)
    comms.all_reduce_(total, world_group)
    return (total / state.dp_cp.size).item()
