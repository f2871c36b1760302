"""The interleaved (virtual) pipeline schedule (issue #17 section 3): model chunks, validation, the executed
op order against the simulation, and on 4 gloo ranks (pp 2, V 2) x dp 2 and (pp 2, V 2, ep 2) against the
single-process model: first-step gradients of every parameter, the 10-step loss curve, the evaluation loss,
the point-to-point traffic, and a V = 2 checkpoint resumed at pp 2 V 1 and at pp 1.

The fast tests play each pipeline rank in this process over torch's fake process group (every collective a
no-op, receive buffers left as allocated): the values are meaningless there, the order of what runs is not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.gradients import main_grad
from megamoe.models import GPTMoEModel
from megamoe.pipeline.partition import chunk_layer_ranges
from megamoe.pipeline import (PipelineOp, check_interleaved_layout, forward_backward, forward_backward_interleaved,
                              forward_only, interleaved_1f1b_order, simulate_pipeline)
from megamoe.pipeline.nccl_ordering import check_nccl_ordering
from megamoe.spawned_ranks import run_on_ranks
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.evaluation import evaluate_loss
from megamoe.training.trainer import TrainConfig, Trainer
from p2p_recording import fake_rank, recording_p2p
from parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from test_training import V as VOCAB
from test_training import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_LAYERS, SEQ, MICRO_BATCH, MICRO_BATCHES, DP, STEPS, SAVE_AT = 4, 8, 1, 4, 2, 10, 8
EVAL_MICRO_BATCHES = 3          # per DP rank: not a multiple of pp, so the evaluation pads
REL_TOL = 1e-5                  # the loss curve over STEPS steps, fp32 (the bound)
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)     # first-step gradients: other summation orders, fp32
LR, CLIP = 1e-2, 0.5            # every step clipped


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


# ---------------------------------------------------------------------------------------------------------
# 4 gloo ranks against the single-process model
# ---------------------------------------------------------------------------------------------------------
LAYOUTS = {"pp2-v2-dp2": dict(pp=2, ep=1), "pp2-v2-ep2-alltoall": dict(pp=2, ep=2)}


SAVED = "pp2-v2-ep2-alltoall"     # the layout whose checkpoint (at SAVE_AT) resumes at pp 2 V 1 and at pp 1


def _config():
    """The tiny MoE model of tests/test_training.py with every layer MoE (one per chunk) and tied
    embeddings (copies on the first and the last pipeline rank)."""
    return dataclasses.replace(tiny_config("alltoall", num_layers=NUM_LAYERS), tie_word_embeddings=True,
                               moe_layer_ids=tuple(range(NUM_LAYERS)))


def _global_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, VOCAB, (DP * MICRO_BATCHES * MICRO_BATCH, SEQ + 1), generator=g)


def _micro_batches(rows: torch.Tensor):
    return [(mb[:, :-1], mb[:, 1:]) for mb in rows.split(MICRO_BATCH)]


def _my_rows(state, rows_per_rank: int, batch: torch.Tensor):
    return batch[state.dp_cp.rank * rows_per_rank:(state.dp_cp.rank + 1) * rows_per_rank]


def _trainer(state, v: int, world_group):
    model = GPTMoEModel(_config(), state, virtual_pipeline_stages=v)
    initialize_parameters(model, seed=0)
    return Trainer(model, state, TrainConfig(lr=LR, grad_clip=CLIP), world_group=world_group)


def _capture_first_step_gradients(trainer) -> dict:
    """Wrap the optimizer's step: before the first one, copy every gradient (synced over DP, tied copies
    summed), keyed by name; expert weights keep their global expert ids (the slots this rank holds)."""
    grads: dict = {}
    step = trainer.optimizer.step
    slots = {}
    for layer_id, layer in trainer.model.moe_layers().items():
        local = layer.placement.local_slots(trainer.state.ep.rank)
        slots[f"layers.{layer_id}.mlp."] = layer.placement.slot_to_expert[list(local)].tolist()

    def capturing_step(*args, **kwargs):
        if not grads:
            for name, p in trainer.model.named_parameters():
                experts = next((ids for prefix, ids in slots.items() if name.startswith(prefix)), None)
                grads[name] = (main_grad(p).detach().clone(), experts if getattr(p, "expert_parallel", False) else None)
        return step(*args, **kwargs)

    trainer.optimizer.step = capturing_step
    return grads


def _train(trainer, state, steps, save=None, world_group=None):
    rows = MICRO_BATCHES * MICRO_BATCH * DP // state.dp_cp.size
    curve = []
    for step in range(steps):
        m = trainer.train_step(_micro_batches(_my_rows(state, rows, _global_batch())))
        curve.append((m.loss, m.grad_norm, m.aux_loss))
        if save is not None and trainer.step == SAVE_AT:
            from megamoe.training.checkpoint import save_training_checkpoint
            save_training_checkpoint(save, trainer, sampler_state=None, world_group=world_group)
    return curve


def _eval_loss(trainer, state, world_group):
    rows = EVAL_MICRO_BATCHES * MICRO_BATCH * DP // state.dp_cp.size
    batch = _global_batch().roll(1, dims=1)[:EVAL_MICRO_BATCHES * MICRO_BATCH * DP]
    return evaluate_loss(trainer.model, state, _micro_batches(_my_rows(state, rows, batch)), world_group=world_group)


def _logits_and_greedy_tokens(model, state):
    """The full logits [B, S, V] of the first rows (every rank) and 4 greedy tokens of two prompts."""
    from megamoe.inference.generation import GenerationConfig, generate
    from megamoe.inference.pipeline_forward import pipeline_logits
    model.eval()
    logits = pipeline_logits(model, state, _global_batch()[:2, :-1]).numpy()
    tokens = generate(model, state, [[1, 2, 3], [5, 4]], GenerationConfig(max_new_tokens=4)).token_ids
    model.train()
    return logits, tokens


def _non_finite_step(trainer, state) -> tuple[bool, list[str]]:
    """A step whose forward goes NaN at layer 1 (virtual stage 1: chunk 0 of pp rank 1): skipped, and the
    warning names the module, found by re-running pp micro-batches through the interleaved schedule."""
    import logging
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("megamoe.training.trainer")
    logger.addHandler(handler)
    hooks = []
    if "1" in trainer.model.layers:
        norm = trainer.model.layers["1"].post_attention_layernorm
        hooks.append(norm.register_forward_hook(lambda module, inputs, output: output * float("nan")))
    try:
        rows = MICRO_BATCHES * MICRO_BATCH * DP // state.dp_cp.size
        metrics = trainer.train_step(_micro_batches(_my_rows(state, rows, _global_batch())))
    finally:
        for hook in hooks:
            hook.remove()
        logger.removeHandler(handler)
    return metrics.skipped, [m for m in messages if "skipped" in m]


def _step_with_m_equal_to_pp(state, world_group):
    """A fresh model's first step with as many micro-batches per DP rank as pipeline ranks (m == pp: the
    interleaved order without an "every forward first" warm-up, see interleaved_1f1b_order): its first-step
    gradients and (loss, grad norm)."""
    trainer = _trainer(state, 2 if state.pp.size > 1 else 1, world_group)
    grads = _capture_first_step_gradients(trainer)
    rows = 2 * MICRO_BATCH * DP // state.dp_cp.size
    metrics = trainer.train_step(_micro_batches(_my_rows(state, rows, _global_batch()[:2 * MICRO_BATCH * DP])))
    return grads, (metrics.loss, metrics.grad_norm)


def _reference() -> dict:
    state = ParallelState.single_process()
    trainer = _trainer(state, 1, None)
    grads = _capture_first_step_gradients(trainer)
    curve = _train(trainer, state, STEPS)
    return {"grads": grads, "curve": curve, "m=pp": _step_with_m_equal_to_pp(state, None)}


def _worker(rank, world_size, checkpoint):
    from megamoe.training.checkpoint import load_training_checkpoint
    world = dist.group.WORLD
    results = {}
    for name, layout in LAYOUTS.items():
        state = initialize_model_parallel(pp=layout["pp"], ep=layout["ep"])
        assert state.dp_cp.size == DP and state.pp.size == 2
        trainer = _trainer(state, 2, world)
        eval_before = _eval_loss(trainer, state, world)
        logits, tokens = _logits_and_greedy_tokens(trainer.model, state)
        grads = _capture_first_step_gradients(trainer)
        with comms.comm_counter() as counter:
            curve = _train(trainer, state, STEPS, save=checkpoint if name == SAVED else None, world_group=world)
        if name == SAVED:
            results["non-finite"] = _non_finite_step(trainer, state)
        m_equal_pp_grads, m_equal_pp_metrics = _step_with_m_equal_to_pp(state, world)
        results[name] = {"grads": grads, "curve": curve, "eval": eval_before, "logits": logits, "tokens": tokens,
                         "p2p": (counter.calls("send", group=state.pp.ranks), counter.calls("recv", group=state.pp.ranks),
                                 counter.bytes("send", group=state.pp.ranks)),
                         "m=pp grads": m_equal_pp_grads, "m=pp": m_equal_pp_metrics}
        destroy_model_parallel()
    # The V = 2 checkpoint (saved at SAVE_AT) resumes at pp 2 with one chunk per rank (and dp 2, ep 1).
    state = initialize_model_parallel(pp=2)
    trainer = _trainer(state, 1, world)
    load_training_checkpoint(checkpoint, trainer, world_group=world)
    results["resumed-pp2-v1"] = _train(trainer, state, STEPS - SAVE_AT)
    destroy_model_parallel()
    for name in LAYOUTS:     # plain arrays: tensors would travel through shared memory the exiting rank frees
        for key in ("grads", "m=pp grads"):
            results[name][key] = {k: (g.numpy(), e) for k, (g, e) in results[name][key].items()}
    return results


def _close(got, want, rel=REL_TOL):
    return all(abs(g - w) <= rel * abs(w) + 1e-9 for g, w in zip(got, want))


@pytest.mark.slow
def test_interleaved_pipeline_matches_the_single_process_model(tmp_path):
    from megamoe.training.checkpoint import load_training_checkpoint
    checkpoint = str(tmp_path / "v2")
    per_rank = run_on_ranks(_worker, 4, args=(checkpoint,), timeout_s=150)
    reference = _reference()
    state = ParallelState.single_process()
    eval_reference = _eval_loss(_trainer(state, 1, None), state, None)
    ref_logits, ref_tokens = _logits_and_greedy_tokens(_trainer(state, 1, None).model, state)

    for name in LAYOUTS:
        for rank, results in enumerate(per_rank):
            run, what = results[name], f"{name} rank {rank}"
            for step, (got, want) in enumerate(zip(run["curve"], reference["curve"]), start=1):
                assert _close(got, want), f"{what} step {step}: {got} vs {want}"
            assert run["curve"][-1][0] < run["curve"][0][0] - 0.05, f"{what}: the loss must fall"
            assert run["eval"] == pytest.approx(eval_reference, rel=REL_TOL), what
            # The logits through the ring of chunks (pipeline_logits) and greedy generation.
            diff = abs(run["logits"] - ref_logits).max()
            assert diff <= 1e-5 * abs(ref_logits).max(), f"{what}: logits differ by {diff:.3e}"
            assert run["tokens"] == ref_tokens, what
            # pp 2, V 2, m 4: each rank holds one end of the ring (stage 0 or 3) and two inner boundaries.
            sends, recvs, nbytes = run["p2p"]
            assert sends == recvs == STEPS * 3 * MICRO_BATCHES, (what, run["p2p"])
            assert nbytes == sends * MICRO_BATCH * SEQ * _config().hidden_size * 4, what
        # Every parameter's first-step gradient, on the rank(s) that hold it, equals the reference's; also
        # in a step with m == pp micro-batches per DP rank.
        for key, reference_grads in (("grads", reference["grads"]), ("m=pp grads", reference["m=pp"][0])):
            seen = set()
            for rank, results in enumerate(per_rank):
                for param, (grad, experts) in results[name][key].items():
                    grad = torch.from_numpy(grad)
                    want = reference_grads[param][0]
                    if experts is not None:
                        want = want[experts]
                    assert torch.allclose(grad, want, **GRAD_TOL), \
                        f"{name} rank {rank} {key} {param}: max diff {(grad - want).abs().max().item():.3e}"
                    seen.add(param)
            assert seen == set(reference_grads), f"{name}: parameters held by no rank {set(reference_grads) - seen}"
        for rank, results in enumerate(per_rank):
            assert _close(results[name]["m=pp"], reference["m=pp"][1]), (name, rank, results[name]["m=pp"])
        # The tied embedding: its copies on the first and the last rank have identical gradients.
        assert (per_rank[0][name]["grads"]["embed_tokens.weight"][0] ==
                    per_rank[1][name]["grads"]["embed_tokens.weight"][0]).all()

    # A NaN forward at virtual stage 1 (layer 1) is found there, not at pp rank 0's later chunk 1 (layer 2).
    for rank, results in enumerate(per_rank):
        skipped, warnings = results["non-finite"]
        assert skipped and len(warnings) == 1, (rank, warnings)
        assert "output of module 'layers.1.post_attention_layernorm' went non-finite first in the forward" \
            in warnings[0], warnings[0]

    # The V = 2 checkpoint reshards: pp 2 V 1 (inside the spawn) and one process (here) continue the curve.
    tied = reference["curve"][SAVE_AT:]
    for rank, results in enumerate(per_rank):
        for step, (got, want) in enumerate(zip(results["resumed-pp2-v1"], tied), start=SAVE_AT + 1):
            assert _close(got, want), f"pp2 V2 -> pp2 V1, rank {rank}, step {step}: {got} vs {want}"
    state = ParallelState.single_process()
    trainer = _trainer(state, 1, None)
    load_training_checkpoint(checkpoint, trainer, world_group=None)
    for step, (got, want) in enumerate(zip(_train(trainer, state, STEPS - SAVE_AT), tied), start=SAVE_AT + 1):
        assert _close(got, want), f"pp2 V2 -> pp1, step {step}: {got} vs {want}"
