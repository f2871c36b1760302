"""Pipeline-schedule simulation (no ranks): op orders, timelines and bubble fractions.

The 1F1B order is checked against what ``forward_backward_1f1b`` really executes (its p2p and the
autograd backward replaced by recorders, so one process can play any stage); the interleaved order
against its defining properties (Megatron-Core's chunk / micro-batch mapping and warm-up length); the
simulated bubble against the closed forms, and every timeline against the dependencies it must respect.
"""

import pytest
import torch

from megamoe.pipeline import (PipelineOp, forward_backward_1f1b, interleaved_1f1b_order, one_f_one_b_order,
                              simulate_pipeline)
from megamoe.pipeline import schedule as schedule_module

SHAPE = (1, 2)


class _RecordingP2P:
    """Stands in for StageP2P: hands out activations / gradients as if the neighbours existed."""

    def __init__(self, group, prev_rank, next_rank, tensor_shape, dtype, device):
        self.first, self.last, self.shape = prev_rank is None, next_rank is None, tensor_shape

    def _activation(self):
        return None if self.first else torch.zeros(self.shape)

    def _grad(self):
        return None if self.last else torch.zeros(self.shape)

    def recv_forward(self):
        return self._activation()

    def recv_backward(self):
        return self._grad()

    def send_forward(self, activation):
        pass

    def send_backward(self, input_grad):
        pass

    def send_forward_recv_backward(self, activation):
        return self._grad()

    def send_backward_recv_forward(self, input_grad):
        return self._activation()


def _executed_1f1b_order(monkeypatch, pp, rank, m):
    """The ops ``forward_backward_1f1b`` runs on stage ``rank``, in order."""
    ops = []
    monkeypatch.setattr(schedule_module, "StageP2P", _RecordingP2P)
    monkeypatch.setattr(schedule_module, "_check_pipeline_args", lambda *args: None)

    def record_backward(input_tensor, output, aux_loss, output_grad):
        ops.append(PipelineOp("B", int(output.flatten()[0]), 0))   # the output carries its micro-batch index
        return None if rank == 0 else torch.zeros(SHAPE)
    monkeypatch.setattr(schedule_module, "backward_step", record_backward)

    def forward_step(input_tensor, index):
        ops.append(PipelineOp("F", index, 0))
        return torch.full((1,) if rank == pp - 1 else SHAPE, float(index))

    forward_backward_1f1b(forward_step, m, pp_group=None, pp_rank=rank, pp_size=pp,
                          prev_rank=None if rank == 0 else rank - 1, next_rank=None if rank == pp - 1 else rank + 1,
                          tensor_shape=SHAPE, dtype=torch.float32)
    return ops


@pytest.mark.parametrize("pp, m", [(1, 3), (2, 1), (2, 5), (4, 2), (4, 4), (4, 7)])
def test_1f1b_order_is_what_the_real_schedule_runs(monkeypatch, pp, m):
    for rank in range(pp):
        assert one_f_one_b_order(pp, rank, m) == _executed_1f1b_order(monkeypatch, pp, rank, m), (pp, rank, m)


def test_1f1b_order_small_case_spelled_out():
    f, b = (lambda i: PipelineOp("F", i, 0)), (lambda i: PipelineOp("B", i, 0))
    assert one_f_one_b_order(3, 0, 4) == [f(0), f(1), f(2), b(0), f(3), b(1), b(2), b(3)]
    assert one_f_one_b_order(3, 2, 4) == [f(0), b(0), f(1), b(1), f(2), b(2), f(3), b(3)]
    assert one_f_one_b_order(4, 0, 2) == [f(0), f(1), b(0), b(1)]   # warm-up capped at m


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 4), (1, 3, 2), (2, 6, 2), (2, 2, 2),
                                     (4, 4, 2)])
def test_interleaved_order_follows_megatron_mapping(pp, m, v):
    for rank in range(pp):
        ops = interleaved_1f1b_order(pp, rank, m, v)
        forwards = [op for op in ops if op.kind == "F"]
        backwards = [op for op in ops if op.kind == "B"]
        # Every (micro-batch, chunk) once forward and once backward.
        everything = sorted((i, c) for i in range(m) for c in range(v))
        assert sorted(op[1:] for op in forwards) == everything
        assert sorted(op[1:] for op in backwards) == everything
        # Micro-batches in groups of pp: a group goes through chunks 0..V-1 forward, V-1..0 backward.
        group_size = pp * v
        for k, op in enumerate(forwards):
            assert op == PipelineOp("F", (k // group_size) * pp + k % pp, (k % group_size) // pp)
        for k, op in enumerate(backwards):
            assert op == PipelineOp("B", (k // group_size) * pp + k % pp, v - 1 - (k % group_size) // pp)
        # Warm-up: the forwards before the first backward; Megatron-Core's rule, also at m == pp (no
        # "every forward first" there since its November 2024 schedule).
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)
        first_backward = ops.index(backwards[0])
        assert first_backward == warmup + (1 if warmup < m * v else 0)
        # Then strictly alternating F, B until the forwards run out.
        steady = ops[warmup:warmup + 2 * (m * v - warmup)]
        assert [op.kind for op in steady] == ["F", "B"] * (m * v - warmup)


def test_interleaved_order_at_as_many_micro_batches_as_stages_spelled_out():
    """m == pp: the last rank starts its steady 1F1B after the first chunk's forwards, as Megatron-Core's
    get_pp_rank_microbatches counts the warm-up; only the first rank's warm-up covers every forward."""
    f, b = (lambda i, c: PipelineOp("F", i, c)), (lambda i, c: PipelineOp("B", i, c))
    assert interleaved_1f1b_order(2, 1, 2, 2) == [f(0, 0), f(1, 0), f(0, 1), b(0, 1), f(1, 1), b(1, 1),
                                                  b(0, 0), b(1, 0)]
    assert interleaved_1f1b_order(2, 0, 2, 2) == [f(0, 0), f(1, 0), f(0, 1), f(1, 1), b(0, 1), b(1, 1),
                                                  b(0, 0), b(1, 0)]
    # pp 4, V 2, m 4: a warm-up of 2 (pp - rank - 1) + pp forwards, capped at the 8 there are (ranks 0
    # and 1); the first backward follows it, after one more forward where the warm-up left some.
    first_backward = [next(k for k, op in enumerate(interleaved_1f1b_order(4, rank, 4, 2)) if op.kind == "B")
                      for rank in range(4)]
    assert first_backward == [8, 8, 6 + 1, 4 + 1]


def test_interleaved_needs_micro_batches_divisible_by_pp():
    with pytest.raises(ValueError, match=r"num_micro_batches \(m=6\).*\(pp=4\)"):
        interleaved_1f1b_order(4, 0, 6, 2)
    with pytest.raises(ValueError, match=r"m=6.*pp=4"):
        simulate_pipeline(4, 6, virtual_stages=2)
    simulate_pipeline(4, 6)   # plain 1F1B has no such constraint


def _check_timeline(sim, f, b, p2p):
    """Every op ran exactly once, ranks ran one op at a time in their schedule's order, and no op started
    before its dependency finished (plus the transfer time across ranks)."""
    pp, m, v = sim.pp, sim.num_micro_batches, sim.virtual_stages
    end = {}
    for rank, line in enumerate(sim.timelines):
        order = one_f_one_b_order(pp, rank, m) if v == 1 else interleaved_1f1b_order(pp, rank, m, v)
        assert [t.op for t in line] == order
        assert len(set(order)) == len(order) == 2 * m * v
        for prev, cur in zip(line, line[1:]):
            assert cur.start >= prev.end - 1e-12
        for t in line:
            assert t.end - t.start == pytest.approx((f if t.op.kind == "F" else b) / v)
            end[(t.op.kind, t.op.micro_batch, t.op.chunk * pp + rank)] = (t.end, rank)
    last = pp * v - 1
    for rank, line in enumerate(sim.timelines):
        for t in line:
            stage = t.op.chunk * pp + rank
            if t.op.kind == "F":
                deps = [] if stage == 0 else [("F", t.op.micro_batch, stage - 1)]
            else:
                deps = [("F", t.op.micro_batch, stage)]
                if stage != last:
                    deps.append(("B", t.op.micro_batch, stage + 1))
            for dep in deps:
                dep_end, dep_rank = end[dep]
                assert t.start >= dep_end + (p2p if dep_rank != rank else 0.0) - 1e-9, (t, dep)
    assert sim.makespan == max(line[-1].end for line in sim.timelines)


CASES = [(pp, m, v) for pp in (1, 2, 3, 4, 8) for v in (1, 2, 3) for m in (1, 2, 3, 4, 6, 8, 12, 16)
         if v == 1 or m % pp == 0]


@pytest.mark.parametrize("f, b", [(1.0, 2.0), (1.0, 1.0), (3.0, 2.0)])
def test_bubble_matches_the_closed_form(f, b):
    for pp, m, v in CASES:
        sim = simulate_pipeline(pp, m, virtual_stages=v, forward_time=f, backward_time=b)
        _check_timeline(sim, f, b, 0.0)
        expected = (pp - 1) / (v * m + pp - 1)
        assert sim.ideal_time == pytest.approx(m * (f + b))
        assert sim.busy_time == pytest.approx([m * (f + b)] * pp)
        assert sim.makespan == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / v), (pp, m, v)
        assert sim.bubble_fraction == pytest.approx([expected] * pp), (pp, m, v)
        assert sim.mean_bubble_fraction == pytest.approx(expected)
        assert sim.max_bubble_fraction == pytest.approx(expected)
        assert sim.bubble_over_ideal == pytest.approx((pp - 1) / (v * m))


def test_more_virtual_stages_shrink_the_bubble():
    fractions = [simulate_pipeline(4, 8, virtual_stages=v).max_bubble_fraction for v in (1, 2, 4)]
    assert fractions[0] > fractions[1] > fractions[2] > 0


def test_p2p_time_lengthens_the_step():
    for pp, m, v in [(2, 4, 1), (4, 8, 1), (4, 2, 1), (4, 8, 2), (2, 4, 3)]:
        base = simulate_pipeline(pp, m, virtual_stages=v)
        slow = simulate_pipeline(pp, m, virtual_stages=v, p2p_time=0.25)
        _check_timeline(slow, 1.0, 2.0, 0.25)
        # At least the forward chain down and the backward chain up pay pp - 1 transfers each.
        assert slow.makespan >= base.makespan + 2 * (pp - 1) * 0.25 - 1e-9
        assert slow.busy_time == pytest.approx(base.busy_time)
        assert slow.max_bubble_fraction > base.max_bubble_fraction
    one_stage = simulate_pipeline(1, 4, p2p_time=5.0)   # nothing to transfer
    assert one_stage.makespan == pytest.approx(12.0) and one_stage.max_bubble_fraction == 0.0


@pytest.mark.parametrize("kwargs, field", [
    (dict(pp=0, num_micro_batches=4), "pp"),
    (dict(pp=2.0, num_micro_batches=4), "pp"),
    (dict(pp=2, num_micro_batches=0), "num_micro_batches"),
    (dict(pp=2, num_micro_batches=4, virtual_stages=0), "virtual_stages"),
    (dict(pp=2, num_micro_batches=4, forward_time=0.0), "forward_time"),
    (dict(pp=2, num_micro_batches=4, backward_time=-1.0), "backward_time"),
    (dict(pp=2, num_micro_batches=4, backward_time=float("nan")), "backward_time"),
    (dict(pp=2, num_micro_batches=4, p2p_time=-0.1), "p2p_time"),
])
def test_invalid_inputs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        simulate_pipeline(**kwargs)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match=r"rank must be in \[0, pp=2\)"):
        one_f_one_b_order(2, 2, 4)
