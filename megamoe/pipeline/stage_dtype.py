"""The dtype of the hidden states pipeline stages exchange: the residual stream's, i.e. the parameters'.

The one rule that the Trainer, the schedules' receive buffers, :func:`~megamoe.training.evaluation.evaluate_loss`
and generation read. Autocast does not change it: autocast runs the GEMMs in bf16 / fp16, but each residual
addition promotes their outputs back to the dtype of the stream, which starts as the embedding's output (the
parameter dtype). So under fp32 parameters and bf16 autocast a stage's output is fp32, and fp32 goes between
stages, and a pipelined run computes what one stage computes (tests/multirank/test_training.py: pp 2 under bf16 autocast
gives the single process's losses; bf16 between the stages would move the grad norm by 1.5e-4 relative at
the first step and 3.5e-2 at the third). Megatron-LM's rule is the same:
its p2p tensors are in ``pipeline_dtype`` = ``params_dtype`` (megatron/training/argument_utils.py), and in fp32
under ``fp32_residual_connection``, "to match the dtype of the residual stream between pipeline stages"
(megatron/core/transformer/transformer_config.py; read at commit d98e8a6 of 2026-08-22).

Gradients come back in the same dtype: the receiving stage's input is a leaf of that dtype, and autograd
gives a tensor's gradient its dtype.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["stage_hidden_dtype"]


def stage_hidden_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the hidden states between ``model``'s pipeline stages (see the module docstring): that
    of its first floating-point parameter of at least 16 bits (kept fp8 weights hold no activations).
    ValueError for a model without one."""
    for p in model.parameters():
        if p.is_floating_point() and p.element_size() >= 2:
            return p.dtype
    raise ValueError(f"{type(model).__name__} has no floating-point parameter of 16 bits or more: the dtype of "
                     "the hidden states between its pipeline stages is that of its parameters")
