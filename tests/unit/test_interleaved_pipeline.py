"""The interleaved (virtual) pipeline schedule (issue #17 section 3).

The in-process cases; those that spawn ranks or run scripts end to end are in
tests/multirank/test_interleaved_pipeline.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe import comms
from megamoe.models import GPTMoEModel
from megamoe.pipeline.partition import chunk_layer_ranges
from megamoe.pipeline import (check_interleaved_layout, forward_backward, forward_backward_interleaved, forward_only,
                              interleaved_1f1b_order, simulate_pipeline)
from megamoe.pipeline.nccl_ordering import check_nccl_ordering
from tests.helpers.p2p_recording import fake_rank, recording_p2p
from parallel_state import ParallelState
from tests.helpers.tiny_model import tiny_config
from tests.helpers.interleaved_pipeline import NUM_LAYERS, _config, _recording_steps

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------------
# Model chunks and validation (no ranks)
# ---------------------------------------------------------------------------------------------------------
def test_chunks_take_megatron_virtual_stages():
    # Virtual stage v = chunk * pp + rank: rank r holds chunks r, r + pp, ... (non-adjacent layers).
    assert chunk_layer_ranges(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert chunk_layer_ranges(8, 4, 2) == [[range(0, 1), range(4, 5)], [range(1, 2), range(5, 6)],
                                           [range(2, 3), range(6, 7)], [range(3, 4), range(7, 8)]]
    assert chunk_layer_ranges(12, 2, 3) == [[range(0, 2), range(4, 6), range(8, 10)],
                                            [range(2, 4), range(6, 8), range(10, 12)]]
    # An explicit split gives one count per virtual stage, in virtual-stage order.
    assert chunk_layer_ranges(7, 2, 2, pp_split=[1, 2, 3, 1]) == [[range(0, 1), range(3, 6)],
                                                                  [range(1, 3), range(6, 7)]]
    # V = 1 is the plain pipeline split.
    assert chunk_layer_ranges(10, 4) == [[range(0, 3)], [range(3, 6)], [range(6, 8)], [range(8, 10)]]
    # The 4-rank test's model has an MoE layer with an aux loss in every chunk.
    config = _config()
    for rank_chunks in chunk_layer_ranges(NUM_LAYERS, 2, 2):
        for layers in rank_chunks:
            assert any(config.is_moe_layer(i) for i in layers), layers
    assert config.moe.router.aux_loss_coeff > 0


@pytest.mark.parametrize("args, message", [
    ((8, 2, 0), "virtual_pipeline_stages must be an int >= 1, got 0"),
    ((8, 1, 2), r"virtual_pipeline_stages=2 needs pipeline parallelism \(pp > 1\), got pp=1"),
    ((6, 2, 2), r"num_layers \(6\) must split into pp \* virtual_pipeline_stages = 2 \* 2 = 4"),
    ((2, 2, 2), r"num_layers \(2\) must split into pp \* virtual_pipeline_stages = 2 \* 2 = 4"),
    ((8, 2, 2, [4, 4]), r"pp_split has 2 entries, but pp \* virtual_pipeline_stages = 2 \* 2 = 4"),
    ((8, 2, 2, [4, 4, 1, 0]), "sums to 9 but num_layers is 8"),
])
def test_bad_virtual_layouts_name_the_numbers(args, message):
    with pytest.raises(ValueError, match=message):
        chunk_layer_ranges(*args)


def test_the_schedule_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match=r"m=6 is not a multiple of pp=4"):
        check_interleaved_layout(4, 2, 6)
    with pytest.raises(ValueError, match=r"pp > 1\), got pp=1"):
        check_interleaved_layout(1, 2, 4)
    with pytest.raises(ValueError, match="num_micro_batches must be >= 1"):
        check_interleaved_layout(2, 2, 0)
    # Through forward_backward: a list of two steps is interleaved, and a single process has no pipeline.
    with pytest.raises(ValueError, match=r"got pp=1 with 2 model chunks"):
        forward_backward([lambda x, i: x, lambda x, i: x], 2, ParallelState.single_process(), (1,), torch.float32)
    with pytest.raises(ValueError, match="empty list"):
        forward_only([], 2, ParallelState.single_process(), (1,), torch.float32)
    # A model with virtual stages needs a pipeline.
    with pytest.raises(ValueError, match=r"virtual_pipeline_stages=2 needs pipeline parallelism"):
        GPTMoEModel(tiny_config(num_layers=4), ParallelState.single_process(), virtual_pipeline_stages=2)


def test_one_chunk_is_the_whole_stage():
    model = GPTMoEModel(tiny_config(num_layers=4), ParallelState.single_process())
    assert model.virtual_pipeline_stages == 1 and model.chunk_is_first(0) and model.chunk_is_last(0)
    assert [[id(p) for p in chunk] for chunk in model.chunk_parameters()] == [[id(p) for p in model.parameters()]]
    with pytest.raises(ValueError, match=r"chunk must be an int in \[0, virtual_pipeline_stages=1\), got 1"):
        model.chunk_is_first(1)


# ---------------------------------------------------------------------------------------------------------
# Each rank in turn, over the fake process group
# ---------------------------------------------------------------------------------------------------------
def test_model_chunks_on_each_rank_hold_their_layers_and_parameters():
    pp, v = 2, 2
    config = dataclasses.replace(tiny_config(num_layers=NUM_LAYERS), tie_word_embeddings=True)
    for rank in range(pp):
        with fake_rank(rank, pp, pp=pp) as state:
            model = GPTMoEModel(config, state, virtual_pipeline_stages=v)
            expected = chunk_layer_ranges(NUM_LAYERS, pp, v)[rank]
            assert [list(r) for r in model.chunk_layer_ids] == [list(r) for r in expected]
            # ONE module, layers keyed by global id (checkpoints, gradient sync, optimizers unchanged).
            assert sorted(int(k) for k in model.layers) == sorted(i for r in expected for i in r)
            assert set(model.moe_layers()) == {i for r in expected for i in r if config.is_moe_layer(i)}
            assert model.is_first_stage == (rank == 0) and model.is_last_stage == (rank == pp - 1)
            assert [model.chunk_is_first(c) for c in range(v)] == [rank == 0, False]
            assert [model.chunk_is_last(c) for c in range(v)] == [False, rank == pp - 1]
            chunks = model.chunk_parameters()
            flat = [id(p) for chunk in chunks for p in chunk]
            assert sorted(flat) == sorted(id(p) for p in model.parameters()) and len(set(flat)) == len(flat)
            names = {id(p): n for n, p in model.named_parameters()}
            for c, chunk in enumerate(chunks):
                layer_ids = {int(names[id(p)].split(".")[1]) for p in chunk if names[id(p)].startswith("layers.")}
                assert layer_ids == set(expected[c]), (rank, c, layer_ids)
            # The embedding with chunk 0 on rank 0; the final norm and the tied copy with the last chunk.
            where = {names[id(p)]: c for c, chunk in enumerate(chunks) for p in chunk}
            assert where["embed_tokens.weight"] == (0 if rank == 0 else v - 1)
            if rank == pp - 1:
                assert where["norm.weight"] == v - 1
            assert len(model.tied_parameters()) == 1


@pytest.mark.parametrize("pp, v, m", [(2, 2, 4), (2, 2, 2), (4, 2, 8), (3, 3, 6), (2, 4, 6)])
def test_executed_order_is_the_simulated_one(pp, v, m):
    shape = (2, 3)
    simulated_bubble = simulate_pipeline(pp, m, v).mean_bubble_fraction
    assert simulated_bubble == pytest.approx((pp - 1) / (v * m + pp - 1))
    posts: dict[str, dict[int, list]] = {"training": {}, "evaluation": {}}
    for rank in range(pp):
        with fake_rank(rank, pp, pp=pp) as state:
            executed: list = []
            hooks: list = []

            def on_last_backward(chunk):
                hooks.append((chunk, len(executed)))

            with comms.comm_counter() as counter, recording_p2p() as posts["training"][rank]:
                losses = forward_backward_interleaved(_recording_steps(rank, pp, v, executed, shape), m, state=state,
                                                      tensor_shape=shape, dtype=torch.float32,
                                                      on_last_backward=on_last_backward)
            order = interleaved_1f1b_order(pp, rank, m, v)
            assert executed == order, (pp, v, m, rank)
            # The hook runs once per chunk, just before that chunk's last backward.
            last = {op.chunk: i for i, op in enumerate(order) if op.kind == "B"}
            assert sorted(hooks) == sorted((c, i) for c, i in last.items()), (hooks, last)
            assert len(losses) == (m if rank == pp - 1 else 0)
            # One activation per micro-batch out of every chunk but the last virtual stage, one gradient
            # per micro-batch out of every chunk but the first: all sends, all receives on the pp group.
            stages = [c * pp + rank for c in range(v)]
            sends = m * (sum(s != pp * v - 1 for s in stages) + sum(s != 0 for s in stages))
            assert counter.kinds() == {"send": sends, "recv": sends}, counter.kinds()
            assert counter.bytes("send", group=state.pp.ranks) == sends * 2 * 3 * 4

            # Evaluation: the forwards in the same order, no backward traffic.
            executed.clear()
            with comms.comm_counter() as counter, recording_p2p() as posts["evaluation"][rank]:
                forward_only(_recording_steps(rank, pp, v, executed, shape), m, state, shape, torch.float32)
            assert executed == [op for op in order if op.kind == "F"]
            forwards = m * sum(s != pp * v - 1 for s in stages)
            assert counter.calls("send") == m * sum(s != pp * v - 1 for s in stages) and \
                counter.calls("recv") == m * sum(s != 0 for s in stages), (forwards, counter.kinds())
    # Between any two ranks the receiver posts its receives in the order the sender posts the sends (the
    # tags of the messages paired by order agree: NCCL ignores tags), and under NCCL's ordering rules the
    # exchanges complete even when every send waits for its receive.
    for name, recorded in posts.items():
        result = check_nccl_ordering(recorded, buffer_bytes=0)
        assert result.completed, (name, result.problem)


# ---------------------------------------------------------------------------------------------------------
# The training script: flag checks (one error line, before any work) and the schedule's log line
# ---------------------------------------------------------------------------------------------------------
SCRIPT_ERRORS = {   # name: (arguments, WORLD_SIZE, fragment of the error line)
    "V without pp": (["--virtual-pipeline-stages", "2"], "1", "--virtual-pipeline-stages 2 interleaves model chunks "
                     "over a pipeline: it needs --pp > 1, got --pp 1"),
    "V below 1": (["--virtual-pipeline-stages", "0"], "1", "--virtual-pipeline-stages must be >= 1, got 0"),
    "layers": (["--pp", "2", "--virtual-pipeline-stages", "2", "--layers", "6"], "2",
               "--virtual-pipeline-stages 2 with --pp 2: --layers (6) must split into pp * V = 4 virtual stages"),
    "micro-batches": (["--pp", "2", "--virtual-pipeline-stages", "2", "--layers", "4", "--global-batch", "6",
                       "--micro-batch", "2"], "2", "micro-batches per step (m = --global-batch / (dp * --micro-batch) "
                      "= 3) to be a multiple of --pp 2"),
}


@pytest.mark.parametrize("case", SCRIPT_ERRORS)
def test_script_refuses_bad_virtual_layouts_in_one_line(demo, case, tmp_path, capsys, monkeypatch):
    from megamoe.cli.launch import run_script
    extra, world, fragment = SCRIPT_ERRORS[case]
    monkeypatch.setenv("WORLD_SIZE", world)
    work = tmp_path / "work"
    argv = ["--work-dir", work, "--save-dir", tmp_path / "ckpt", "--corpus-bytes", "200000", "--hidden", "32", *extra]
    code = run_script(demo.main, [str(a) for a in argv], prog=demo.PROG)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("pretrain_moe.py: error: "), err
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err and not out and not work.exists()


def test_schedule_log_line_reports_the_simulated_bubble():
    from megamoe.pipeline import describe_pipeline_schedule
    assert describe_pipeline_schedule(2, 8, 2) == ("pipeline: interleaved 1F1B, pp 2 x 2 virtual stages, 8 micro-batches: "
                                                   "bubble 5.9% (simulated, uniform stage times)")     # 1 / 17
    assert describe_pipeline_schedule(4, 8) == ("pipeline: 1F1B, pp 4, 8 micro-batches: bubble 27.3% (simulated, "
                                                "uniform stage times)")                               # 3 / 11
    assert describe_pipeline_schedule(1, 4).startswith("pipeline: none (one stage), 4 micro-batches")
