"""The interleaved (virtual) pipeline schedule (issue #17 section 3): model chunks, validation, the executed
op order against the simulation, and on 4 gloo ranks (pp 2, V 2) x dp 2 and (pp 2, V 2, ep 2) against the
single-process model: first-step gradients of every parameter, the 10-step loss curve, the evaluation loss,
the point-to-point traffic, and a V = 2 checkpoint resumed at pp 2 V 1 and at pp 1.

The fast tests play each pipeline rank in this process over torch's fake process group (every collective a
no-op, receive buffers left as allocated): the values are meaningless there, the order of what runs is not."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.gradients import main_grad
from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training.evaluation import evaluate_loss
from megamoe.training.trainer import TrainConfig, Trainer
from parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from tests.helpers.tiny_model import V as VOCAB
from tests.helpers.interleaved_pipeline import DP, MICRO_BATCH, MICRO_BATCHES, SAVE_AT, SEQ, STEPS, _config

pytestmark = pytest.mark.usefixtures("one_thread")
EVAL_MICRO_BATCHES = 3          # per DP rank: not a multiple of pp, so the evaluation pads
REL_TOL = 1e-5                  # the loss curve over STEPS steps, fp32 (the bound)
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)     # first-step gradients: other summation orders, fp32
LR, CLIP = 1e-2, 0.5            # every step clipped


# ---------------------------------------------------------------------------------------------------------
# 4 gloo ranks against the single-process model
# ---------------------------------------------------------------------------------------------------------
LAYOUTS = {"pp2-v2-dp2": dict(pp=2, ep=1), "pp2-v2-ep2-alltoall": dict(pp=2, ep=2)}


SAVED = "pp2-v2-ep2-alltoall"     # the layout whose checkpoint (at SAVE_AT) resumes at pp 2 V 1 and at pp 1


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
