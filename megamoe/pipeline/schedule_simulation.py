"""Simulate pipeline schedules without ranks: op order per stage, timelines and the bubble fraction.

For planning big layouts (how many micro-batches, how many virtual stages), this module replays a
schedule on a model of the machine instead of running it:

- :func:`one_f_one_b_order` is the op order of one pipeline rank under non-interleaved 1F1B, exactly as
  :func:`megamoe.pipeline.schedule.forward_backward_1f1b` runs it (warm-up forwards
  ``min(pp - rank - 1, m)``, then one forward / one backward, then the remaining backwards).
- :func:`interleaved_1f1b_order` is the op order of one rank under interleaved 1F1B with ``V`` virtual
  stages (model chunks) per rank, as Megatron-Core orders it (``--num-layers-per-virtual-pipeline-stage``).
  :func:`megamoe.pipeline.interleaved.forward_backward_interleaved` runs exactly this order.
- :func:`simulate_pipeline` runs those orders event-driven and reports makespan, busy time and bubble.

Model of the machine
--------------------
The pipeline has ``pp * V`` virtual stages; virtual stage ``v = chunk * pp + rank`` (rank ``r`` holds
model chunks ``r, r + pp, ...``). Each rank runs its op list strictly in order, one op at a time. An op
starts when its rank is free AND its dependency has finished (plus ``p2p_time`` when the dependency ran
on another rank): the forward of micro-batch ``i`` on virtual stage ``v`` needs the forward of ``i`` on
``v - 1``; the backward of ``i`` on ``v`` needs the backward of ``i`` on ``v + 1`` (on the last virtual
stage: its own forward, which always precedes it on the same rank). Sends are asynchronous (a rank never
waits for its consumer), so this is the schedule's dependency-limited timeline, the usual model behind the
bubble formulas. ``forward_time`` / ``backward_time`` are those of a whole pipeline STAGE (all its layers)
for one micro-batch; with ``V`` virtual stages each chunk's op takes ``1 / V`` of them.

Closed forms (uniform times, ``p2p_time = 0``; checked by tests/unit/test_schedule_simulation.py)
------------------------------------------------------------------------------------------------
Every rank is busy ``ideal_time = m * (f + b)`` (its share of the work, the makespan of a pipeline
without bubble). The makespan is ``ideal_time + (pp - 1) * (f + b) / V``, so for every rank

    bubble_fraction = 1 - busy / makespan = (pp - 1) / (V * m + pp - 1)

and ``bubble_time / ideal_time = (pp - 1) / (V * m)`` (the Megatron interleaving paper's ratio). ``V = 1``
is plain 1F1B: ``(pp - 1) / (m + pp - 1)``. The simulation reproduces these exactly for any ``f, b``, every
``m`` with ``V = 1`` (also ``m < pp``) and every ``m`` multiple of ``pp`` with ``V > 1`` (the tests sweep
``pp`` up to 8, ``V`` up to 4); every rank then has the same bubble, so mean and worst agree. With
``p2p_time > 0`` the simulation reports what the formula leaves out (each transfer on the critical path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

__all__ = ["PipelineOp", "PipelineSimulation", "TimedOp", "describe_pipeline_schedule", "interleaved_1f1b_order",
           "one_f_one_b_order", "replay_orders", "simulate_pipeline"]


class PipelineOp(NamedTuple):
    """One op of a rank: ``kind`` "F" (forward) or "B" (backward) of ``micro_batch`` on model ``chunk``
    (the rank's local chunk index, 0 .. V - 1; always 0 without interleaving)."""
    kind: str
    micro_batch: int
    chunk: int


class TimedOp(NamedTuple):
    """An op with the times it started and ended in the simulation."""
    start: float
    end: float
    op: PipelineOp


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_rank(pp: int, rank: int) -> None:
    _check_int("pp", pp, 1)
    _check_int("rank", rank, 0)
    if rank >= pp:
        raise ValueError(f"rank must be in [0, pp={pp}), got {rank}")


def one_f_one_b_order(pp: int, rank: int, num_micro_batches: int) -> list[PipelineOp]:
    """Op order of pipeline rank ``rank`` under non-interleaved 1F1B over ``num_micro_batches``.

    Mirrors the three loops of :func:`~megamoe.pipeline.schedule.forward_backward_1f1b`: ``w = min(pp - rank
    - 1, m)`` warm-up forwards; ``m - w`` steady steps, each the forward of micro-batch ``w + step`` then
    the backward of the oldest pending one (backwards run in micro-batch order); ``w`` cool-down backwards.
    """
    _check_rank(pp, rank)
    _check_int("num_micro_batches", num_micro_batches, 1)
    m = num_micro_batches
    num_warmup = min(pp - rank - 1, m)
    ops = [PipelineOp("F", i, 0) for i in range(num_warmup)]
    next_backward = 0
    for step in range(m - num_warmup):
        ops.append(PipelineOp("F", num_warmup + step, 0))
        ops.append(PipelineOp("B", next_backward, 0))
        next_backward += 1
    ops.extend(PipelineOp("B", i, 0) for i in range(next_backward, m))
    return ops


def _interleaved_op(k: int, pp: int, virtual_stages: int, forward: bool) -> PipelineOp:
    """The ``k``-th forward (or backward) of a rank under interleaving: micro-batches go in groups of
    ``pp``; a group runs through chunk 0, 1, ... (forwards) or V - 1, V - 2, ... (backwards) before the
    next group starts."""
    group, within = divmod(k, pp * virtual_stages)
    chunk = within // pp
    micro_batch = group * pp + within % pp
    if not forward:
        chunk = virtual_stages - 1 - chunk
    return PipelineOp("F" if forward else "B", micro_batch, chunk)


def interleaved_1f1b_order(pp: int, rank: int, num_micro_batches: int, virtual_stages: int) -> list[PipelineOp]:
    """Op order of rank ``rank`` under interleaved 1F1B (Megatron-Core's schedule) with ``virtual_stages``
    model chunks per rank.

    The rank runs ``m * V`` forwards and as many backwards. Warm-up: ``min((pp - rank - 1) * 2 + (V - 1)
    * pp, m * V)`` forwards, the rule of Megatron-Core's ``get_pp_rank_microbatches``
    (megatron/core/pipeline_parallel/schedules.py, with its default ``microbatch_group_size_per_vp_stage =
    pp``), also when ``m == pp``: Megatron-Core ran every forward first in that case until its commit
    4295be1a6c (November 2024) dropped the rule; then steady steps of one forward and one backward; then the
    remaining backwards. The ``k``-th forward is micro-batch ``(k // (pp V)) * pp + k % pp`` on chunk ``(k % (pp V))
    // pp``; the ``k``-th backward the same micro-batch on chunk ``V - 1 -`` that. Requires ``m % pp ==
    0`` (ValueError otherwise). With ``V = 1`` this is a valid 1F1B order, but its warm-up (``2 (pp - rank - 1)``)
    is longer than megamoe's; Megatron never takes its interleaved path with V = 1, and neither does
    :func:`simulate_pipeline` (it uses :func:`one_f_one_b_order`).
    """
    _check_rank(pp, rank)
    _check_int("num_micro_batches", num_micro_batches, 1)
    _check_int("virtual_stages", virtual_stages, 1)
    m, v = num_micro_batches, virtual_stages
    if m % pp:
        raise ValueError(f"interleaved 1F1B needs num_micro_batches (m={m}) divisible by the pipeline size "
                         f"(pp={pp})")
    total = m * v
    num_warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    ops = [_interleaved_op(k, pp, v, True) for k in range(num_warmup)]
    for step in range(total - num_warmup):
        ops.append(_interleaved_op(num_warmup + step, pp, v, True))
        ops.append(_interleaved_op(step, pp, v, False))
    ops.extend(_interleaved_op(k, pp, v, False) for k in range(total - num_warmup, total))
    return ops


@dataclass(frozen=True)
class PipelineSimulation:
    """Result of :func:`simulate_pipeline`.

    ``timelines[r]`` is rank ``r``'s ops in the order it ran them, with start/end times. ``busy_time[r]``
    is the sum of its op durations; ``ideal_time`` is the work of one rank, ``m * (f + b)`` (the same
    on every rank, and the makespan a bubble-free pipeline would have). ``bubble_fraction[r] = 1 -
    busy_time[r] / makespan``; ``mean_bubble_fraction`` / ``max_bubble_fraction`` over ranks.
    ``bubble_time = makespan - ideal_time``, ``bubble_over_ideal = bubble_time / ideal_time``.
    """
    pp: int
    num_micro_batches: int
    virtual_stages: int
    makespan: float
    ideal_time: float
    busy_time: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    mean_bubble_fraction: float
    max_bubble_fraction: float
    bubble_time: float
    bubble_over_ideal: float
    timelines: tuple[tuple[TimedOp, ...], ...]


def _check_time(name: str, value, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


def simulate_pipeline(pp: int, num_micro_batches: int, virtual_stages: int = 1, forward_time: float = 1.0,
                      backward_time: float = 2.0, p2p_time: float = 0.0) -> PipelineSimulation:
    """Simulate one training step's pipeline schedule and report its bubble (see the module docstring for
    the machine model and the closed forms).

    ``virtual_stages == 1`` simulates megamoe's 1F1B (:func:`one_f_one_b_order`); more simulates
    Megatron-Core's interleaved 1F1B (:func:`interleaved_1f1b_order`, needs ``num_micro_batches % pp ==
    0``). ``forward_time`` / ``backward_time`` are per micro-batch and per whole stage; ``p2p_time`` is the
    latency of one stage-to-stage transfer.
    """
    _check_int("pp", pp, 1)
    _check_int("num_micro_batches", num_micro_batches, 1)
    _check_int("virtual_stages", virtual_stages, 1)
    _check_time("forward_time", forward_time, positive=True)
    _check_time("backward_time", backward_time, positive=True)
    _check_time("p2p_time", p2p_time, positive=False)
    v, m = virtual_stages, num_micro_batches
    if v == 1:
        orders = [one_f_one_b_order(pp, r, m) for r in range(pp)]
    else:
        orders = [interleaved_1f1b_order(pp, r, m, v) for r in range(pp)]
    duration = {"F": forward_time / v, "B": backward_time / v}
    timelines = replay_orders(orders, v, duration["F"], duration["B"], p2p_time)
    free = [line[-1].end if line else 0.0 for line in timelines]
    makespan = max(free)
    busy = tuple(sum(duration[t.op.kind] for t in line) for line in timelines)
    ideal = m * (forward_time + backward_time)
    fractions = tuple(1.0 - b / makespan for b in busy)
    return PipelineSimulation(
        pp=pp, num_micro_batches=m, virtual_stages=v, makespan=makespan, ideal_time=ideal, busy_time=busy,
        bubble_fraction=fractions, mean_bubble_fraction=sum(fractions) / pp, max_bubble_fraction=max(fractions),
        bubble_time=makespan - ideal, bubble_over_ideal=(makespan - ideal) / ideal,
        timelines=timelines,
    )


def replay_orders(orders: Sequence[Sequence[PipelineOp]], virtual_stages: int, op_forward_time: float = 1.0,
                  op_backward_time: float = 1.0, p2p_time: float = 0.0) -> tuple[tuple[TimedOp, ...], ...]:
    """Run the op lists ``orders[rank]`` (one per pipeline rank, ``virtual_stages`` chunks each) on the
    machine model of the module docstring: each op starts when its rank is free and its input is there;
    ``op_forward_time`` / ``op_backward_time`` are one op's (one chunk's) durations. Returns each
    rank's timeline. AssertionError if the orders wait on each other (a schedule bug) or run an op twice.
    """
    pp = len(orders)
    last_stage = pp * virtual_stages - 1
    duration = {"F": op_forward_time, "B": op_backward_time}
    end: dict[tuple[str, int, int], float] = {}   # (kind, micro-batch, virtual stage) -> end time

    def ready_at(rank: int, op: PipelineOp) -> float | None:
        """When ``op``'s input is available on ``rank`` (None: its dependency has not run yet)."""
        stage = op.chunk * pp + rank
        if op.kind == "F":
            dep = None if stage == 0 else ("F", op.micro_batch, stage - 1)
        else:
            dep = ("F", op.micro_batch, stage) if stage == last_stage else ("B", op.micro_batch, stage + 1)
        if dep is None:
            return 0.0
        if dep not in end:
            return None
        return end[dep] + (p2p_time if dep[2] % pp != rank else 0.0)

    position = [0] * pp
    free = [0.0] * pp
    timelines: list[list[TimedOp]] = [[] for _ in range(pp)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank in range(pp):
            # Run this rank's ops as far as their dependencies allow; start times only depend on ops
            # already placed, so the sweep order over ranks does not change the result.
            while position[rank] < len(orders[rank]):
                op = orders[rank][position[rank]]
                ready = ready_at(rank, op)
                if ready is None:
                    break
                start = max(free[rank], ready)
                finish = start + duration[op.kind]
                key = (op.kind, op.micro_batch, op.chunk * pp + rank)
                if key in end:
                    raise AssertionError(f"schedule runs {op} on rank {rank} twice")
                end[key] = finish
                free[rank] = finish
                timelines[rank].append(TimedOp(start, finish, op))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:   # an order whose ops wait on each other across ranks: a schedule bug
            raise AssertionError(f"pipeline schedule deadlocks at positions {position}")

    return tuple(tuple(line) for line in timelines)


def describe_pipeline_schedule(pp: int, num_micro_batches: int, virtual_stages: int = 1) -> str:
    """One line for a training log: the schedule a step runs and its simulated bubble (uniform stage times,
    no transfer latency: :func:`simulate_pipeline`), e.g. ``pipeline: interleaved 1F1B, pp 2 x 2 virtual
    stages, 8 micro-batches: bubble 5.9% (simulated, uniform stage times)``."""
    if pp == 1:
        return f"pipeline: none (one stage), {num_micro_batches} micro-batches of gradient accumulation: no bubble"
    simulation = simulate_pipeline(pp, num_micro_batches, virtual_stages)
    schedule = (f"interleaved 1F1B, pp {pp} x {virtual_stages} virtual stages" if virtual_stages > 1
                else f"1F1B, pp {pp}")
    return (f"pipeline: {schedule}, {num_micro_batches} micro-batches: bubble "
            f"{100 * simulation.mean_bubble_fraction:.1f}% (simulated, uniform stage times)")
