"""Shared by tests/unit/test_interleaved_pipeline.py and tests/multirank/test_interleaved_pipeline.py (and other
tests): the builders and constants of the interleaved pipeline tests."""

from __future__ import annotations

import dataclasses

import torch

from megamoe.pipeline import PipelineOp
from tests.helpers.tiny_model import tiny_config

NUM_LAYERS, SEQ, MICRO_BATCH, MICRO_BATCHES, DP, STEPS, SAVE_AT = 4, 8, 1, 4, 2, 10, 8


def _recording_steps(rank, pp, v, executed, shape):
    """Forward steps that record what runs: a forward when called, a backward when the gradient of
    their output arrives (a tensor hook fires inside that micro-batch's backward)."""
    weight = torch.nn.Parameter(torch.ones(()))

    def step_of(chunk):
        last = chunk * pp + rank == pp * v - 1

        def step(input_tensor, index):
            assert (input_tensor is None) == (chunk * pp + rank == 0)
            executed.append(PipelineOp("F", index, chunk))
            # Received values are garbage over the fake group: only the graph matters.
            hidden = (torch.zeros(shape) if input_tensor is None else input_tensor.nan_to_num(0.0, 0.0, 0.0)) * weight
            output = hidden.sum() if last else hidden
            if torch.is_grad_enabled():
                output.register_hook(lambda grad: executed.append(PipelineOp("B", index, chunk)))
            return output, (weight * 0.0 if chunk == 0 else None)
        return step
    return [step_of(c) for c in range(v)]


def _config():
    """The tiny MoE model of tests/helpers/tiny_model.py with every layer MoE (one per chunk) and tied
    embeddings (copies on the first and the last pipeline rank)."""
    return dataclasses.replace(tiny_config("alltoall", num_layers=NUM_LAYERS), tie_word_embeddings=True,
                               moe_layer_ids=tuple(range(NUM_LAYERS)))
