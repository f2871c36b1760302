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
way: per micro-batch and virtual stage boundary, one activation forward and one gradient backward, all
``tensor_shape`` and ``dtype``.

Every transfer is part of a batched exchange (:func:`megamoe.comms.batch_send_recv`, one
``batch_isend_irecv`` group, waited), as Megatron-Core's ``batch_p2p_comm`` does. The exchanges follow a
clock that all ranks share: :func:`exchange_plan` replays the op orders of every rank with one tick per op
(:func:`~megamoe.pipeline.schedule_simulation.replay_orders`); a message produced by an op ending at tick
``t`` is sent AND received at tick ``t``, the receiver keeping it until the op that reads it (which starts
at ``t`` or later). Each rank posts its exchange of tick ``t`` after its ops that ended by ``t`` and before
the ones that start at ``t``. So each exchange pairs with its neighbours' exchanges of the same tick, and
all of a tick's exchanges complete once every rank got there, which it does once the earlier ticks
completed: no cycle of waits, whatever the buffering (NCCL posts the operations between two ranks on one
stream, in order, and a large send waits for its receive; unbatched ``isend`` + blocking ``recv``
deadlocked there, :mod:`megamoe.pipeline.nccl_ordering` shows it). Between two ranks, messages of one
direction are posted in tick order on both sides, so NCCL, which ignores tags, pairs the right ones; the
tags still name (direction, receiving virtual stage, micro-batch) for gloo and for the ordering model.

Gradients are accumulated into ``.grad`` exactly as under 1F1B (each micro-batch's backward is that of
``<output, grad_from_next> + aux_loss``); nothing is reduced here. ``on_last_backward(chunk)`` is called
just before the backward of chunk ``chunk``'s last micro-batch on this rank: after it, that chunk's
parameters receive no more gradient this step (a hook for gradient reductions overlapped with the rest
of the backward).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch

from megamoe import comms
from megamoe.pipeline.schedule_simulation import PipelineOp, interleaved_1f1b_order, replay_orders
from megamoe.pipeline.stage_step import ForwardStep, backward_step, check_num_micro_batches, forward_step_checked

if TYPE_CHECKING:
    from parallel_state import ParallelState

__all__ = ["check_interleaved_layout", "exchange_plan", "forward_backward_interleaved", "forward_only_interleaved"]

logger = logging.getLogger(__name__)


def check_interleaved_layout(pp: int, virtual_stages: int, num_micro_batches: int) -> None:
    """ValueError naming the numbers unless the interleaved schedule can run: pp > 1, V >= 1 model
    chunks, and a number of micro-batches ``m`` that is a positive multiple of pp."""
    check_num_micro_batches(num_micro_batches)
    if virtual_stages < 1:
        raise ValueError(f"the interleaved schedule needs at least one forward step (model chunk), got "
                         f"{virtual_stages}")
    if pp < 2:
        raise ValueError(f"the interleaved schedule needs pipeline parallelism (pp > 1), got pp={pp} with "
                         f"{virtual_stages} model chunks; run one chunk with the plain schedule")
    if num_micro_batches % pp:
        raise ValueError(f"the interleaved pipeline schedule needs the number of micro-batches to be a multiple of "
                         f"the pipeline size: m={num_micro_batches} is not a multiple of pp={pp}")


# A message between virtual stages: ("F", receiving stage, micro-batch) is the activation the forward
# of that micro-batch on that stage reads, ("B", receiving stage, micro-batch) the gradient its backward reads.
Message = tuple[str, int, int]


class Exchange(NamedTuple):
    """One batched post of a rank: the messages it sends and receives at one tick."""
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


def _message_out(op: PipelineOp, stage: int, last_stage: int) -> Message | None:
    """The message ``op`` on virtual stage ``stage`` produces (None: the last forward, the first backward)."""
    if op.kind == "F":
        return None if stage == last_stage else ("F", stage + 1, op.micro_batch)
    return None if stage == 0 else ("B", stage - 1, op.micro_batch)


def _message_in(op: PipelineOp, stage: int, last_stage: int) -> Message | None:
    """The message ``op`` on virtual stage ``stage`` reads (None: the first forward, the last backward)."""
    if stage == (last_stage if op.kind == "B" else 0):
        return None
    return (op.kind, stage, op.micro_batch)


@functools.lru_cache(maxsize=32)
def exchange_plan(pp: int, rank: int, num_micro_batches: int, virtual_stages: int,
                  forward_only: bool = False) -> tuple[PipelineOp | Exchange, ...]:
    """Rank ``rank``'s ops (:func:`interleaved_1f1b_order`, only its forwards with ``forward_only``)
    with its batched exchanges between them, in the order it runs them (see the module docstring)."""
    orders = [[op for op in interleaved_1f1b_order(pp, r, num_micro_batches, virtual_stages)
               if not forward_only or op.kind == "F"] for r in range(pp)]
    last_stage = pp * virtual_stages - 1
    exchanges: dict[float, tuple[list, list]] = {}     # tick -> (sends, receives) of this rank
    items: list[tuple[float, int, PipelineOp | None]] = []
    for r, timeline in enumerate(replay_orders(orders, virtual_stages)):
        for timed in timeline:
            stage = timed.op.chunk * pp + r
            message = _message_out(timed.op, stage, last_stage)
            receiver = (r + 1) % pp if timed.op.kind == "F" else (r - 1) % pp
            if message is not None and rank in (r, receiver):
                exchanges.setdefault(timed.end, ([], []))[0 if r == rank else 1].append(message)
            if r == rank:
                items.append((timed.start, 1, timed.op))
    items += [(tick, 0, None) for tick in exchanges]   # a tick's exchange before the op starting then
    return tuple(op if op is not None else Exchange(*map(tuple, exchanges[tick])) for tick, _, op in sorted(items))


class _Ring:
    """This rank's links around the pipeline ring: the tensors of its messages and their exchanges."""

    def __init__(self, state: ParallelState, virtual_stages: int, num_micro_batches: int,
                 tensor_shape: tuple[int, ...], dtype: torch.dtype, device):
        self.group, self.pp, self.rank = state.pp.group, state.pp.size, state.pp.rank
        ranks = state.pp.ranks
        self.next_rank = ranks[(self.rank + 1) % self.pp]     # global ranks: the ring wraps around
        self.prev_rank = ranks[(self.rank - 1) % self.pp]
        self.m, self.last_stage = num_micro_batches, self.pp * virtual_stages - 1
        self.shape, self.dtype, self.device = tensor_shape, dtype, device
        self.received: dict[Message, torch.Tensor] = {}
        self.outgoing: dict[Message, torch.Tensor] = {}

    def stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def _tag(self, message: Message) -> int:
        """A message's tag: gloo matches by it; NCCL ignores it, and the ordering model checks the
        matched messages carry the same one."""
        kind, receiving_stage, micro_batch = message
        return 1 + 2 * (receiving_stage * self.m + micro_batch) + int(kind == "B")

    def _peer(self, message: Message, sending: bool) -> int:
        """Activations go to the next rank and come from the previous one; gradients the other way."""
        return self.next_rank if (message[0] == "F") == sending else self.prev_rank

    def input_of(self, op: PipelineOp) -> torch.Tensor | None:
        """What ``op`` reads from another stage (received at an earlier exchange), None on the ends."""
        message = _message_in(op, self.stage(op.chunk), self.last_stage)
        return None if message is None else self.received.pop(message)

    def output_of(self, op: PipelineOp, tensor: torch.Tensor | None) -> None:
        """Hold what ``op`` produced until the exchange that sends it (the next one)."""
        message = _message_out(op, self.stage(op.chunk), self.last_stage)
        if message is not None:
            self.outgoing[message] = tensor

    def exchange(self, exchange: Exchange) -> None:
        """One :func:`megamoe.comms.batch_send_recv`: this tick's sends and receives, posted together."""
        sends = [(self.outgoing.pop(m), self._peer(m, True), self._tag(m)) for m in exchange.sends]
        recvs = [(torch.empty(self.shape, dtype=self.dtype, device=self.device), self._peer(m, False), self._tag(m))
                 for m in exchange.recvs]
        for message, buffer in zip(exchange.recvs, comms.batch_send_recv(sends, recvs, self.group)):
            self.received[message] = buffer

    def check_drained(self) -> None:
        assert not self.received and not self.outgoing, "interleaved schedule left messages unsent or unread"


def _prepare(forward_steps, num_micro_batches, state, tensor_shape, dtype, device, forward_only=False):
    steps = list(forward_steps)
    check_interleaved_layout(state.pp.size, len(steps), num_micro_batches)
    tensor_shape = tuple(int(d) for d in tensor_shape)
    ring = _Ring(state, len(steps), num_micro_batches, tensor_shape, dtype, device)
    plan = exchange_plan(state.pp.size, state.pp.rank, num_micro_batches, len(steps), forward_only)
    return steps, tensor_shape, ring, plan


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
    steps, tensor_shape, ring, plan = _prepare(forward_steps, num_micro_batches, state, tensor_shape, dtype,
                                               device)
    logger.debug("interleaved 1F1B rank %d/%d: %d chunks, %d micro-batches", state.pp.rank, state.pp.size,
                 len(steps), num_micro_batches)
    ops = [item for item in plan if isinstance(item, PipelineOp)]
    last_backward = {op.chunk: op for op in ops if op.kind == "B"}
    in_flight: dict[tuple[int, int], tuple] = {}      # (chunk, micro-batch) -> (input, output, aux_loss)
    losses: dict[int, torch.Tensor] = {}

    def run_forward(op: PipelineOp) -> None:
        input_tensor = ring.input_of(op)
        if input_tensor is not None:
            input_tensor.requires_grad_()
        is_last = ring.stage(op.chunk) == ring.last_stage
        output, aux_loss = forward_step_checked(steps[op.chunk], input_tensor, op.micro_batch, is_last=is_last,
                                                tensor_shape=tensor_shape, dtype=dtype)
        if is_last:
            losses[op.micro_batch] = output.detach()
        in_flight[op.chunk, op.micro_batch] = (input_tensor, output, aux_loss)
        ring.output_of(op, output)

    def run_backward(op: PipelineOp) -> None:
        output_grad = ring.input_of(op)
        if on_last_backward is not None and last_backward[op.chunk] == op:
            on_last_backward(op.chunk)
        # Popped here so that no caller variable outlives the micro-batch's graph.
        ring.output_of(op, backward_step(*in_flight.pop((op.chunk, op.micro_batch)), output_grad))

    for item in plan:
        if isinstance(item, Exchange):
            ring.exchange(item)
        elif item.kind == "F":
            run_forward(item)
        else:
            run_backward(item)
    ring.check_drained()
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
    steps, tensor_shape, ring, plan = _prepare(forward_steps, num_micro_batches, state, tensor_shape, dtype,
                                               device, forward_only=True)
    losses: dict[int, torch.Tensor] = {}
    for item in plan:
        if isinstance(item, Exchange):
            ring.exchange(item)
            continue
        is_last = ring.stage(item.chunk) == ring.last_stage
        output, _ = forward_step_checked(steps[item.chunk], ring.input_of(item), item.micro_batch,
                                         is_last=is_last, tensor_shape=tensor_shape, dtype=dtype)
        if is_last:
            losses[item.micro_batch] = output
        ring.output_of(item, output)
    ring.check_drained()
    return [losses[i] for i in sorted(losses)]
