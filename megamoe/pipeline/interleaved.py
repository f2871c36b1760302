"""The interleaved (virtual-pipeline) 1F1B schedule: each pipeline rank runs V model chunks.

Layout
------
The model has ``pp * V`` virtual stages; virtual stage ``v = chunk * pp + rank`` is model chunk
``chunk`` of pipeline rank ``rank`` (:class:`~megamoe.models.GPTMoEModel` with
``virtual_pipeline_stages=V``). ``forward_steps[chunk]`` runs that chunk on one micro-batch, with the
signature and return convention of :data:`~megamoe.pipeline.schedule.ForwardStep` (the first virtual
stage gets ``input_tensor=None``, the last returns the scalar loss; any chunk may return an aux loss,
backpropagated with gradient 1 together with its output). Compared with 1F1B on ``pp`` stages, each op
is a ``1 / V`` slice of the stage's work and the bubble shrinks by ``V``: ``(pp - 1) / (V m + pp - 1)``
of the step (:func:`~megamoe.pipeline.schedule_simulation.simulate_pipeline`).

Order
-----
Each rank runs exactly :func:`~megamoe.pipeline.schedule_simulation.interleaved_1f1b_order` (Megatron-Core's
interleaved schedule): warm-up forwards, one forward / one backward in the steady state, then the
remaining backwards; the op list IS the simulated one, so the simulation describes what runs. The number
of micro-batches must be a multiple of ``pp`` (micro-batches go through the chunks in groups of ``pp``).

Communication
-------------
The forward output of chunk ``c`` on rank ``r`` goes to chunk ``c`` on rank ``r + 1``; the last rank's
chunk ``c`` feeds rank 0's chunk ``c + 1`` (a ring over the pipeline group). Gradients flow the reverse
way. Every send is asynchronous (:func:`megamoe.comms.isend`; its handle is kept until it completed, at
the latest until the end of the step) and every receive blocks right before the op that needs it. A
rank therefore never waits for its consumer, only for its producer, which is exactly the machine model of
the simulation: its dependency-driven replay of these orders finishes for every ``(pp, V, m)``, so the
execution cannot deadlock. Each message carries a tag naming its (direction, receiving virtual stage,
micro-batch), so the receiver matches it whatever the order the ranks post in. Per micro-batch and
virtual stage boundary: one activation forward and one gradient backward, ``tensor_shape`` and ``dtype``.

Gradients are accumulated into ``.grad`` exactly as under 1F1B (each micro-batch's backward is that of
``<output, grad_from_next> + aux_loss``); nothing is reduced here. ``on_last_backward(chunk)`` is called
just before the backward of chunk ``chunk``'s last micro-batch on this rank: after it, that chunk's
parameters receive no more gradient this step (a hook for gradient reductions overlapped with the rest
of the backward).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from megamoe import comms
from megamoe.pipeline.schedule import ForwardStep, _backward, _check_num_micro_batches, _forward
from megamoe.pipeline.schedule_simulation import PipelineOp, interleaved_1f1b_order

if TYPE_CHECKING:
    from parallel_state import ParallelState

__all__ = ["check_interleaved_layout", "forward_backward_interleaved", "forward_only_interleaved"]

logger = logging.getLogger(__name__)


def check_interleaved_layout(pp: int, virtual_stages: int, num_micro_batches: int) -> None:
    """ValueError naming the numbers unless the interleaved schedule can run: pp > 1, V >= 1 model
    chunks, and a number of micro-batches ``m`` that is a positive multiple of pp."""
    _check_num_micro_batches(num_micro_batches)
    if virtual_stages < 1:
        raise ValueError(f"the interleaved schedule needs at least one forward step (model chunk), got "
                         f"{virtual_stages}")
    if pp < 2:
        raise ValueError(f"the interleaved schedule needs pipeline parallelism (pp > 1), got pp={pp} with "
                         f"{virtual_stages} model chunks; run one chunk with the plain schedule")
    if num_micro_batches % pp:
        raise ValueError(f"the interleaved pipeline schedule needs the number of micro-batches to be a multiple of "
                         f"the pipeline size: m={num_micro_batches} is not a multiple of pp={pp}")


class _Ring:
    """This rank's links around the pipeline ring: tags, buffers, asynchronous sends, blocking receives."""

    def __init__(self, state: ParallelState, virtual_stages: int, num_micro_batches: int,
                 tensor_shape: tuple[int, ...], dtype: torch.dtype, device):
        self.group, self.pp, self.rank = state.pp.group, state.pp.size, state.pp.rank
        ranks = state.pp.ranks
        self.next_rank = ranks[(self.rank + 1) % self.pp]     # global ranks: the ring wraps around
        self.prev_rank = ranks[(self.rank - 1) % self.pp]
        self.m, self.last_stage = num_micro_batches, self.pp * virtual_stages - 1
        self.shape, self.dtype, self.device = tensor_shape, dtype, device
        self.pending: list[comms.PendingSend] = []

    def stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def _tag(self, backward: bool, receiving_stage: int, micro_batch: int) -> int:
        return 1 + 2 * (receiving_stage * self.m + micro_batch) + int(backward)

    def recv_forward(self, chunk: int, micro_batch: int) -> torch.Tensor | None:
        """Micro-batch ``micro_batch``'s input of ``chunk`` (None on the first virtual stage)."""
        stage = self.stage(chunk)
        if stage == 0:
            return None
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return comms.recv(buffer, self.prev_rank, self.group, tag=self._tag(False, stage, micro_batch))

    def send_forward(self, chunk: int, micro_batch: int, output: torch.Tensor) -> None:
        stage = self.stage(chunk)
        if stage != self.last_stage:
            self.pending.append(comms.isend(output, self.next_rank, self.group,
                                            tag=self._tag(False, stage + 1, micro_batch)))

    def recv_backward(self, chunk: int, micro_batch: int) -> torch.Tensor | None:
        """The gradient of ``chunk``'s output for ``micro_batch`` (None on the last virtual stage)."""
        stage = self.stage(chunk)
        if stage == self.last_stage:
            return None
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return comms.recv(buffer, self.next_rank, self.group, tag=self._tag(True, stage, micro_batch))

    def send_backward(self, chunk: int, micro_batch: int, input_grad: torch.Tensor | None) -> None:
        stage = self.stage(chunk)
        if stage != 0:
            self.pending.append(comms.isend(input_grad, self.prev_rank, self.group,
                                            tag=self._tag(True, stage - 1, micro_batch)))

    def reap(self) -> None:
        """Complete the sends that finished (their tensors can then be freed); the others stay pending."""
        done = [s for s in self.pending if s.work.is_completed()]
        if done:
            comms.wait_sends(done)       # returns at once; surfaces a failed send here
            self.pending = [s for s in self.pending if all(s is not d for d in done)]

    def finish(self) -> None:
        comms.wait_sends(self.pending)
        self.pending = []


def _prepare(forward_steps, num_micro_batches, state, tensor_shape, dtype, device):
    steps = list(forward_steps)
    check_interleaved_layout(state.pp.size, len(steps), num_micro_batches)
    tensor_shape = tuple(int(d) for d in tensor_shape)
    ring = _Ring(state, len(steps), num_micro_batches, tensor_shape, dtype, device)
    order = interleaved_1f1b_order(state.pp.size, state.pp.rank, num_micro_batches, len(steps))
    return steps, tensor_shape, ring, order


def forward_backward_interleaved(
    forward_steps: Sequence[ForwardStep],
    num_micro_batches: int,
    *,
    state: ParallelState,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    on_last_backward: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """Interleaved 1F1B over ``state``'s pipeline group, one forward step per model chunk (see the module
    docstring). ``tensor_shape`` / ``dtype`` / ``device``: the activations between virtual stages.
    Returns the detached per-micro-batch losses (in micro-batch order) on the rank holding the last
    virtual stage, an empty list elsewhere. A micro-batch's input, output and graph on a chunk are
    dropped as soon as its backward there ran."""
    steps, tensor_shape, ring, order = _prepare(forward_steps, num_micro_batches, state, tensor_shape, dtype,
                                                device)
    logger.debug("interleaved 1F1B rank %d/%d: %d chunks, %d micro-batches", state.pp.rank, state.pp.size,
                 len(steps), num_micro_batches)
    last_backward = {op.chunk: position for position, op in enumerate(order) if op.kind == "B"}
    in_flight: dict[tuple[int, int], tuple] = {}      # (chunk, micro-batch) -> (input, output, aux_loss)
    losses: dict[int, torch.Tensor] = {}

    def run_forward(op: PipelineOp) -> None:
        input_tensor = ring.recv_forward(op.chunk, op.micro_batch)
        if input_tensor is not None:
            input_tensor.requires_grad_()
        is_last = ring.stage(op.chunk) == ring.last_stage
        output, aux_loss = _forward(steps[op.chunk], input_tensor, op.micro_batch, is_last=is_last,
                                    tensor_shape=tensor_shape, dtype=dtype)
        if is_last:
            losses[op.micro_batch] = output.detach()
        in_flight[op.chunk, op.micro_batch] = (input_tensor, output, aux_loss)
        ring.send_forward(op.chunk, op.micro_batch, output)

    def run_backward(op: PipelineOp, position: int) -> None:
        output_grad = ring.recv_backward(op.chunk, op.micro_batch)
        if on_last_backward is not None and last_backward[op.chunk] == position:
            on_last_backward(op.chunk)
        # Popped here so that no caller variable outlives the micro-batch's graph.
        input_grad = _backward(*in_flight.pop((op.chunk, op.micro_batch)), output_grad)
        ring.send_backward(op.chunk, op.micro_batch, input_grad)

    for position, op in enumerate(order):
        if op.kind == "F":
            run_forward(op)
        else:
            run_backward(op, position)
        ring.reap()
    ring.finish()
    assert not in_flight, "interleaved 1F1B finished with micro-batches whose backward never ran"
    return [losses[i] for i in sorted(losses)]


@torch.no_grad()
def forward_only_interleaved(
    forward_steps: Sequence[ForwardStep],
    num_micro_batches: int,
    *,
    state: ParallelState,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """Forward every micro-batch through the virtual stages without autograd (evaluation), in the
    forward order of the interleaved schedule; aux losses are ignored. Same layout, messages and
    micro-batch rule as :func:`forward_backward_interleaved`, no backward traffic. Returns the
    per-micro-batch losses on the rank holding the last virtual stage, an empty list elsewhere."""
    steps, tensor_shape, ring, order = _prepare(forward_steps, num_micro_batches, state, tensor_shape, dtype,
                                                device)
    losses: dict[int, torch.Tensor] = {}
    for op in order:
        if op.kind != "F":
            continue
        is_last = ring.stage(op.chunk) == ring.last_stage
        output, _ = _forward(steps[op.chunk], ring.recv_forward(op.chunk, op.micro_batch), op.micro_batch,
                             is_last=is_last, tensor_shape=tensor_shape, dtype=dtype)
        if is_last:
            losses[op.micro_batch] = output
        else:
            ring.send_forward(op.chunk, op.micro_batch, output)
        ring.reap()
    ring.finish()
    return [losses[i] for i in sorted(losses)]
