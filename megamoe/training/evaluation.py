"""Held-out loss: forward-only passes over evaluation micro-batches, through the pipeline.

The evaluation loss is the mean over every labelled token (labels other than -100) of every
micro-batch of every DP rank: each micro-batch's mean token loss is weighted by its labelled-token
count, so the padding rows that :func:`megamoe.data.eval_split.eval_batches` adds to give every DP rank
the same number of micro-batches count for nothing, and the result does not depend on the layout.

Evaluation runs in ``model.eval()`` under ``torch.no_grad``; the MoE layers' load counters see
the evaluation tokens, but the trainer resets them at the start of every step, so evaluation never
feeds the expert-bias update or the load statistics of a training step.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from megamoe import comms
from megamoe.data.eval_split import IGNORE_INDEX
from megamoe.data.packing import micro_batches_on
from megamoe.host_values import host_floats
from megamoe.models.sequence_parallel import stage_hidden_shape
from megamoe.pipeline.schedule import forward_only
from megamoe.pipeline.stage_dtype import stage_hidden_dtype
from megamoe.precision import upcast
from megamoe.training.trainable_model import model_chunk_is_first, model_chunk_is_last

__all__ = ["evaluate_loss"]


@torch.no_grad()
def evaluate_loss(model, state, micro_batches: Sequence, *, world_group=None,
                  autocast_dtype: torch.dtype | None = None) -> float:
    """Mean token loss of ``micro_batches`` (this DP rank's (inputs [mb, S], labels [mb, S]) pairs, or
    :class:`~megamoe.data.packing.MicroBatch` objects, on any device: they are moved to the model's, like the
    Trainer's), identical on every rank; one all-reduce over ``world_group``. ``autocast_dtype``: the forward
    runs under autocast to it (the hidden states between stages stay in the parameters' dtype:
    :mod:`megamoe.pipeline.stage_dtype`)."""
    if not micro_batches:
        raise ValueError("evaluate_loss needs at least one micro-batch on every rank")
    device = next(model.parameters()).device
    micro_batches = micro_batches_on(micro_batches, device)
    autocast = (torch.autocast(device_type=device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    mb, seq = micro_batches[0].inputs.shape

    virtual_stages = getattr(model, "virtual_pipeline_stages", 1)
    if virtual_stages > 1 and len(micro_batches) % state.pp.size:
        # The interleaved schedule takes a multiple of pp micro-batches: pad with copies of the first whose
        # labels are all ignored (weight 0 in the mean below).
        first = micro_batches[0]
        padding = first._replace(labels=torch.full_like(first.labels, IGNORE_INDEX))
        micro_batches = micro_batches + [padding] * (-len(micro_batches) % state.pp.size)

    def chunk_step(chunk: int):
        first, last = model_chunk_is_first(model, chunk), model_chunk_is_last(model, chunk)
        keywords = {"chunk": chunk} if virtual_stages > 1 else {}

        def forward_step(input_tensor, index):
            batch = micro_batches[index]
            with autocast:
                out, _ = model(batch.inputs if first else input_tensor, labels=batch.labels if last else None,
                               **batch.packing_keywords(), **keywords)
            return upcast(out) if last else out
        return forward_step

    forward_step = chunk_step(0) if virtual_stages == 1 else [chunk_step(c) for c in range(virtual_stages)]

    was_training = model.training
    model.eval()
    try:
        losses = forward_only(forward_step, len(micro_batches), state, stage_hidden_shape(model, state, mb, seq),
                              stage_hidden_dtype(model), device)
    finally:
        model.train(was_training)
    # The loss lives on the last stage, identical over TP: one reporter per DP replica and CP rank. Under
    # context parallelism a CP rank's loss is cp x its share of the micro-batch's mean (megamoe.models.gpt_moe):
    # each CP rank adds loss / cp x labelled tokens (its own tokens' loss sum), CP rank 0 the token count.
    totals = torch.zeros(2, dtype=torch.float64, device=device)             # [sum of token losses, tokens]
    if model.is_last_stage and state.tp.rank == 0:
        for loss, batch in zip(losses, micro_batches):
            labelled = (batch.labels != IGNORE_INDEX).sum()
            # A micro-batch of padding only has a NaN mean: weight 0 must drop it, not multiply it.
            totals[0] += torch.where(labelled > 0, loss.double() * labelled / state.cp.size, 0.0)
            if state.cp.rank == 0:
                totals[1] += labelled
    comms.all_reduce_(totals, world_group)
    loss_sum, tokens = host_floats(totals)          # one read; NaN on the meta device (a dry run)
    if tokens == 0:
        raise ValueError("evaluate_loss: the micro-batches hold no labelled token (every label is -100)")
    return loss_sum / tokens
