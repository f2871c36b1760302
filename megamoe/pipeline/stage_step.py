"""One micro-batch through one pipeline stage, as every schedule runs it: the forward step (its output
checked against what the pipeline sends) and its backward. Shared by the plain and 1F1B schedules
(:mod:`megamoe.pipeline.schedule`) and the interleaved one (:mod:`megamoe.pipeline.interleaved`); here, below
both, because the schedule module dispatches to the interleaved one.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

__all__ = ["ForwardStep", "StepOutput", "backward_step", "check_num_micro_batches", "forward_step_checked"]

StepOutput = Union[torch.Tensor, tuple[torch.Tensor, Union[torch.Tensor, None]]]
ForwardStep = Callable[[Union[torch.Tensor, None], int], StepOutput]


def check_num_micro_batches(num_micro_batches: int) -> None:
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")


def forward_step_checked(forward_step: ForwardStep, input_tensor: torch.Tensor | None, index: int, *,
                         is_last: bool, tensor_shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None):
    """Run the step; return ``(output, aux_loss)`` after checking what it returned."""
    result = forward_step(input_tensor, index)
    if isinstance(result, tuple):
        if len(result) != 2:
            raise ValueError(f"forward_step must return output or (output, aux_loss), got a {len(result)}-tuple")
        output, aux_loss = result
    else:
        output, aux_loss = result, None
    if aux_loss is not None and aux_loss.numel() != 1:
        raise ValueError(f"forward_step's aux_loss must be a scalar, got shape {tuple(aux_loss.shape)}")
    if is_last:
        if output.numel() != 1:
            raise ValueError(f"forward_step on the last stage must return the scalar loss, got shape "
                             f"{tuple(output.shape)}")
    elif tuple(output.shape) != tensor_shape or output.dtype != dtype:
        # The receiving stage allocates exactly tensor_shape/dtype: a mismatch would corrupt or hang.
        raise ValueError(f"forward_step returned an activation of shape {tuple(output.shape)} and dtype "
                         f"{output.dtype}, but the pipeline sends tensor_shape={tensor_shape}, dtype={dtype}; "
                         "make the stage output match (or pass the right tensor_shape)")
    return output, aux_loss


def backward_step(input_tensor: torch.Tensor | None, output: torch.Tensor, aux_loss: torch.Tensor | None,
                  output_grad: torch.Tensor | None) -> torch.Tensor | None:
    """Backpropagate one micro-batch through this stage; return its input's gradient (None on the
    first stage). ``output_grad`` is None on the last stage, where ``output`` is the scalar loss."""
    tensors, grads = [], []
    for tensor, grad in ((output, output_grad), (aux_loss, None)):
        if tensor is not None and tensor.requires_grad:   # e.g. a parameter-free first stage: nothing to do
            tensors.append(tensor)
            grads.append(grad)
    if tensors:
        torch.autograd.backward(tensors, grads)
    if input_tensor is None:
        return None
    # An output that does not depend on its input has a zero input gradient; the previous stage still
    # waits for one.
    return input_tensor.grad if input_tensor.grad is not None else torch.zeros_like(input_tensor)
