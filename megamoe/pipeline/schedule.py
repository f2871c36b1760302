"""Forward/backward schedules over micro-batches: plain gradient accumulation and pipelined 1F1B.

:func:`forward_backward` / :func:`forward_only` also take a list of forward steps, one per model chunk:
more than one runs the interleaved schedule of :mod:`megamoe.pipeline.interleaved`.

The forward step
----------------
``forward_step(input_tensor, micro_batch_index)`` runs this stage's part of the model on one
micro-batch and returns either ``output`` or ``(output, aux_loss)``:

- ``input_tensor`` is None on the first stage (the step reads micro-batch ``micro_batch_index``
  itself); elsewhere it is the activation received from the previous stage, a fresh leaf with
  ``requires_grad=True`` so that its gradient can be sent back.
- ``output`` is the activation for the next stage (exactly ``tensor_shape`` and ``dtype``) on every
  stage but the last, and the micro-batch's scalar loss on the last stage.
- ``aux_loss`` (a scalar, or None) is any extra loss computed on this stage, e.g. the MoE
  load-balancing losses of its layers. It is backpropagated on this stage together with the output,
  with gradient 1: the backward of a micro-batch is that of ``<output, grad_from_next> + aux_loss``.

Loss scaling
------------
The schedules never rescale anything: each micro-batch's backward is that of exactly what the step
returned (``loss + aux_loss`` on the last stage). A step that wants the gradient of the MEAN over
micro-batches returns ``loss / num_micro_batches`` (and aux losses already multiplied by their
coefficient and divided by ``num_micro_batches``); the step knows the right normalisation (per
micro-batch, per token over the global batch, ...), the schedule does not. The returned list holds
the step's main losses, detached, in micro-batch order, so under that convention its sum is the
batch loss. Gradients are accumulated into ``.grad`` (for bf16 parameters under the distributed optimizer, a
hook moves each micro-batch's into the fp32 ``main_grad``: :mod:`megamoe.gradients`); nothing is reduced over
data parallelism here.

The last backward
-----------------
``on_last_backward(chunk)`` (optional, every schedule) is called with the model chunk's index (always 0
here: one chunk per stage) just BEFORE the backward of the last micro-batch of that chunk on this stage.
The gradients that backward produces are final, so a gradient reducer
(:mod:`megamoe.training.grad_buckets`) arms its hooks there and starts each bucket's reduction as soon as
its gradients are ready, while the rest of the backward runs.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.pipeline.interleaved import forward_backward_interleaved, forward_only_interleaved
from megamoe.pipeline.p2p import StageP2P
from megamoe.pipeline.stage_step import ForwardStep, backward_step, check_num_micro_batches, forward_step_checked

if TYPE_CHECKING:
    from parallel_state import ParallelState

__all__ = ["ForwardStep", "forward_backward", "forward_backward_1f1b", "forward_backward_no_pipelining", "forward_only"]

logger = logging.getLogger(__name__)

OnLastBackward = Callable[[int], None]


def _whole_micro_batch(forward_step: ForwardStep, index: int, before_backward: OnLastBackward | None = None
                       ) -> torch.Tensor:
    # A function of its own so that no local variable keeps the micro-batch alive after its backward.
    loss, aux_loss = forward_step_checked(forward_step, None, index, is_last=True)
    if before_backward is not None:
        before_backward(0)
    backward_step(None, loss, aux_loss, None)
    return loss.detach()


def forward_backward_no_pipelining(forward_step: ForwardStep, num_micro_batches: int, *,
                                   on_last_backward: OnLastBackward | None = None) -> list[torch.Tensor]:
    """Gradient accumulation on one stage: forward then backward of each micro-batch in turn.

    ``forward_step(None, index)`` returns the micro-batch's scalar loss or ``(loss, aux_loss)`` (see
    the module docstring for the scaling convention). ``on_last_backward(0)``: called before the last
    micro-batch's backward. Returns the detached losses.
    """
    check_num_micro_batches(num_micro_batches)
    last = num_micro_batches - 1
    return [_whole_micro_batch(forward_step, index, on_last_backward if index == last else None)
            for index in range(num_micro_batches)]


def _check_pipeline_args(pp_group, pp_rank, pp_size, prev_rank, next_rank) -> None:
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, pp_size={pp_size}), got {pp_rank}")
    if comms.group_size(pp_group) != pp_size:
        raise ValueError(f"pp_size is {pp_size} but pp_group has {comms.group_size(pp_group)} rank(s); "
                         "pass the pipeline group of this rank (None only when pp_size is 1)")
    if comms.group_rank(pp_group) != pp_rank:
        raise ValueError(f"pp_rank is {pp_rank} but this process is rank {comms.group_rank(pp_group)} of pp_group")
    ranks = comms.group_ranks(pp_group)
    expected_prev = ranks[pp_rank - 1] if pp_rank > 0 else None
    expected_next = ranks[pp_rank + 1] if pp_rank < pp_size - 1 else None
    if (prev_rank, next_rank) != (expected_prev, expected_next):
        raise ValueError(f"prev_rank/next_rank are {prev_rank}/{next_rank} but stage {pp_rank} of pp_group "
                         f"{ranks} has neighbours {expected_prev}/{expected_next} (global ranks, None at the ends)")


def forward_backward_1f1b(
    forward_step: ForwardStep,
    num_micro_batches: int,
    *,
    pp_group: ProcessGroup | None,
    pp_rank: int,
    pp_size: int,
    prev_rank: int | None,
    next_rank: int | None,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    on_last_backward: OnLastBackward | None = None,
) -> list[torch.Tensor]:
    """Non-interleaved one-forward-one-backward pipeline schedule for this stage.

    Stage ``pp_rank`` runs ``min(pp_size - pp_rank - 1, num_micro_batches)`` warmup forwards, then
    alternates one forward and one backward, then finishes the remaining backwards. A micro-batch's
    input, output and graph are dropped as soon as its backward ran, so at most
    ``min(pp_size - pp_rank, num_micro_batches)`` micro-batches are alive on this stage at once.

    ``prev_rank`` / ``next_rank`` are the GLOBAL ranks of the neighbouring stages in ``pp_group``
    (None at the ends); activations and gradients exchanged with them all have ``tensor_shape`` and
    ``dtype`` and live on ``device`` (None: torch's default device). Per micro-batch and neighbour,
    this stage issues exactly one send and one receive. ``forward_step`` and the loss scaling are
    described in the module docstring. ``on_last_backward(0)``: called before the backward of the last
    micro-batch (see the module docstring). Returns the detached per-micro-batch losses on the last
    stage, an empty list elsewhere.
    """
    check_num_micro_batches(num_micro_batches)
    _check_pipeline_args(pp_group, pp_rank, pp_size, prev_rank, next_rank)
    tensor_shape = tuple(int(d) for d in tensor_shape)
    p2p = StageP2P(pp_group, prev_rank, next_rank, tensor_shape, dtype, device)
    is_last = pp_rank == pp_size - 1
    num_warmup = min(pp_size - pp_rank - 1, num_micro_batches)
    num_steady = num_micro_batches - num_warmup
    logger.debug("1F1B stage %d/%d: %d micro-batches, %d warmup", pp_rank, pp_size, num_micro_batches, num_warmup)

    in_flight: deque = deque()   # (input, output, aux_loss) of micro-batches whose backward is pending
    losses: list[torch.Tensor] = []
    backwards_run = 0

    def run_forward(input_tensor: torch.Tensor | None, index: int) -> torch.Tensor:
        if input_tensor is not None:
            input_tensor.requires_grad_()
        output, aux_loss = forward_step_checked(forward_step, input_tensor, index, is_last=is_last,
                                                tensor_shape=tensor_shape, dtype=dtype)
        if is_last:
            losses.append(output.detach())
        in_flight.append((input_tensor, output, aux_loss))
        return output

    def run_backward(output_grad: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal backwards_run
        backwards_run += 1
        if on_last_backward is not None and backwards_run == num_micro_batches:
            on_last_backward(0)
        # Popping here (not in the caller) means no caller variable outlives the micro-batch.
        return backward_step(*in_flight.popleft(), output_grad)

    # Callers never bind an output to a local: the deque holds the only reference, so popping it frees
    # the micro-batch.
    for index in range(num_warmup):
        p2p.send_forward(run_forward(p2p.recv_forward(), index))

    input_tensor = p2p.recv_forward() if num_steady else None
    for step in range(num_steady):
        output_grad = p2p.send_forward_recv_backward(run_forward(input_tensor, num_warmup + step))
        input_grad = run_backward(output_grad)
        if step < num_steady - 1:
            input_tensor = p2p.send_backward_recv_forward(input_grad)
        else:
            p2p.send_backward(input_grad)
            input_tensor = None   # drop our reference: the cooldown must be able to free this micro-batch

    for _ in range(num_warmup):
        p2p.send_backward(run_backward(p2p.recv_backward()))

    assert not in_flight, "1F1B finished with micro-batches whose backward never ran"
    return losses


def _model_chunks(forward_step: ForwardStep | Sequence[ForwardStep]) -> list[ForwardStep] | None:
    """The forward steps of the model chunks when more than one is given (interleaved), else None."""
    if callable(forward_step):
        return None
    steps = list(forward_step)
    if not steps:
        raise ValueError("forward_step: got an empty list of forward steps; pass one per model chunk")
    return steps if len(steps) > 1 else None


def _single_step(forward_step: ForwardStep | Sequence[ForwardStep]) -> ForwardStep:
    return forward_step if callable(forward_step) else list(forward_step)[0]


def forward_backward(
    forward_step: ForwardStep | Sequence[ForwardStep],
    num_micro_batches: int,
    state: ParallelState,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    *,
    on_last_backward: OnLastBackward | None = None,
) -> list[torch.Tensor]:
    """Run the schedule that fits ``state``'s pipeline group: plain gradient accumulation when it has
    one stage, 1F1B otherwise (``tensor_shape``/``dtype``/``device`` are then those of the activations
    between stages). ``forward_step`` may be a list with one forward step per model chunk: more than one
    runs the interleaved schedule (:func:`megamoe.pipeline.interleaved.forward_backward_interleaved`).
    ``on_last_backward(chunk)``: called just before the backward of a chunk's last micro-batch. Returns
    the losses on the last stage, an empty list elsewhere."""
    chunks = _model_chunks(forward_step)
    if chunks is not None:
        return forward_backward_interleaved(chunks, num_micro_batches, state=state, tensor_shape=tensor_shape,
                                            dtype=dtype, device=device, on_last_backward=on_last_backward)
    forward_step = _single_step(forward_step)
    if state.pp.size == 1:
        return forward_backward_no_pipelining(forward_step, num_micro_batches, on_last_backward=on_last_backward)
    return forward_backward_1f1b(
        forward_step, num_micro_batches, pp_group=state.pp.group, pp_rank=state.pp.rank, pp_size=state.pp.size,
        prev_rank=state.pp_prev_rank, next_rank=state.pp_next_rank, tensor_shape=tensor_shape, dtype=dtype,
        device=device, on_last_backward=on_last_backward,
    )


@torch.no_grad()
def forward_only(
    forward_step: ForwardStep | Sequence[ForwardStep],
    num_micro_batches: int,
    state: ParallelState,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """Forward every micro-batch through the pipeline without autograd (evaluation).

    Each stage receives micro-batch ``i``'s activation from the previous stage, runs ``forward_step``
    and sends the output on: one receive and one send per micro-batch and neighbour, no backward
    traffic. ``forward_step`` is the one of :func:`forward_backward` (its aux loss is ignored); a list
    of more than one (one per model chunk) runs
    :func:`megamoe.pipeline.interleaved.forward_only_interleaved`. Returns the per-micro-batch losses
    on the last stage, an empty list elsewhere.
    """
    chunks = _model_chunks(forward_step)
    if chunks is not None:
        return forward_only_interleaved(chunks, num_micro_batches, state=state, tensor_shape=tensor_shape,
                                        dtype=dtype, device=device)
    forward_step = _single_step(forward_step)
    check_num_micro_batches(num_micro_batches)
    tensor_shape = tuple(int(d) for d in tensor_shape)
    pipelined = state.pp.size > 1
    if pipelined:
        _check_pipeline_args(state.pp.group, state.pp.rank, state.pp.size, state.pp_prev_rank, state.pp_next_rank)
    p2p = StageP2P(state.pp.group, state.pp_prev_rank, state.pp_next_rank, tensor_shape, dtype, device) \
        if pipelined else None
    is_last = state.pp.rank == state.pp.size - 1
    losses = []
    for index in range(num_micro_batches):
        input_tensor = p2p.recv_forward() if pipelined else None
        output, _ = forward_step_checked(forward_step, input_tensor, index, is_last=is_last,
                                         tensor_shape=tensor_shape, dtype=dtype)
        if is_last:
            losses.append(output)
        else:
            p2p.send_forward(output)
    return losses
