"""Training under different (tp, pp, dp, ep, etp) layouts reproduces the single-process loss curve,
gradient norm and aux loss: in fp32 over a few steps, with replicated expert slots too, at pp 2 under bf16
autocast, and in fp64
over 30 steps at TP 2 (fp32 rounding, amplified by training, makes long fp32 curves drift)."""

import pytest
import torch
import torch.distributed as dist

from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from tests.helpers.tiny_model import E, GLOBAL_BATCH, MICRO_BATCH, REL_TOL, STEPS, global_batches, tiny_config
from megamoe.spawned_ranks import run_on_ranks


def train_curve(state, dispatcher="alltoall", num_slots=None, world_group=None, *, steps=STEPS, dtype=None,
                autocast=None):
    """Per-step (loss, grad_norm, aux_loss) of the tiny model (parameters in ``dtype``, default fp32, under
    ``TrainConfig.autocast``) trained on this rank's shard of :func:`global_batches` for ``steps`` steps."""
    model = GPTMoEModel(tiny_config(dispatcher, num_slots), state, dtype=dtype)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(lr=1e-2, autocast=autocast), world_group=world_group)
    per_rank = GLOBAL_BATCH // state.dp_cp.size
    curve = []
    for batch in global_batches(steps):
        mine = batch[state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
        micro_batches = [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO_BATCH)]
        m = trainer.train_step(micro_batches)
        curve.append((m.loss, m.grad_norm, m.aux_loss))
    return curve


def _layouts_worker(rank, world_size, layouts):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    curves = []
    for layout in layouts:
        sizes = {k: layout[k] for k in ("tp", "pp", "ep", "etp")}
        state = initialize_model_parallel(**sizes)
        assert state.dp_cp.size == layout["dp"], (layout, state.dp_cp.size)
        curves.append(train_curve(state, layout["dispatcher"], layout.get("slots"), dist.group.WORLD,
                                  autocast=layout["autocast"]))
        destroy_model_parallel()
    return curves


def _layout(tp, pp, dp, ep, etp, dispatcher, slots=None, autocast=None):
    return dict(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, dispatcher=dispatcher, slots=slots, autocast=autocast)


LAYOUTS_2 = [
    _layout(2, 1, 1, 2, 1, "allgather"),
    # fp32 parameters under bf16 autocast (the CUDA default): the stages exchange the fp32 residual stream
    # (megamoe.pipeline.stage_dtype), so pp 2 computes what one stage does, to REL_TOL (measured: the same
    # losses, grad norms within 1e-11). Stages exchanging bf16 instead would be off by 1.5e-4 in the grad norm
    # at the first step and 3.5e-2 at the third (measured by forcing the dtype).
    _layout(1, 2, 1, 1, 1, "alltoall", autocast="bf16"),
]
LAYOUTS_4 = [
    _layout(1, 2, 2, 2, 1, "alltoall"),
    _layout(2, 2, 1, 1, 1, "allgather"),
    _layout(1, 1, 4, 4, 1, "alltoall"),
    _layout(2, 1, 2, 2, 2, "alltoall"),
    _layout(1, 1, 4, 4, 1, "alltoall", slots=2 * E),      # every expert replicated, replicas on other ranks
    _layout(2, 1, 2, 2, 1, "allgather", slots=E + 2),     # two hot-expert replicas
]


def _assert_same_curve(curve, reference, what):
    for step, (got, want) in enumerate(zip(curve, reference)):
        for name, g, w in zip(("loss", "grad_norm", "aux_loss"), got, want):
            assert abs(g - w) <= REL_TOL * abs(w) + 1e-9, f"{what} step {step} {name}: {g} vs {w}"


def _single_thread_curve(autocast):
    """The single-process curve with one thread, like each rank of run_on_ranks: the bf16 GEMMs of autocast
    then sum in the same order."""
    from parallel_state import ParallelState
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_curve(ParallelState.single_process(), autocast=autocast)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_loss_curves_match_single_process_on_every_layout():
    """Every layout against the single process under the same autocast (fp32 parameters; bf16 autocast for
    pp 2)."""
    references = {autocast: _single_thread_curve(autocast)
                  for autocast in {layout["autocast"] for layout in LAYOUTS_2 + LAYOUTS_4}}
    assert all(reference[-1][0] < reference[0][0] for reference in references.values()), "the loss must fall"
    for layouts, world in ((LAYOUTS_2, 2), (LAYOUTS_4, 4)):
        per_rank = run_on_ranks(_layouts_worker, world, args=(layouts,), timeout_s=900)
        for layout, curve in zip(layouts, per_rank[0]):
            for r in range(world):  # every rank reports the same global metrics
                assert per_rank[r][layouts.index(layout)] == curve
            _assert_same_curve(curve, references[layout["autocast"]], str(layout))


LONG_STEPS = 30
# fp64 shrinks the rounding that fp32 amplifies over a long run (see the test below): measured
# <= 1.3e-12 relative over 30 steps at TP 2. Before fp64 models computed their norms, router and
# loss in fp64 (megamoe.precision), the fp32 rounding there alone gave 3e-7 at step 2.
FP64_REL_TOL = 1e-10


def _long_fp64_worker(rank, world_size, layouts):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    curves = []
    for layout in layouts:
        state = initialize_model_parallel(**{k: layout[k] for k in ("tp", "pp", "ep", "etp")})
        curves.append(train_curve(state, layout["dispatcher"], None, dist.group.WORLD, steps=LONG_STEPS,
                                  dtype=torch.float64))
        destroy_model_parallel()
    return curves


@pytest.mark.slow
def test_tp2_matches_single_process_over_30_steps_in_fp64():
    """In fp32, TP 2 drifts from the single-process curve after about 12 steps (loss 2.6e-2, grad norm
    0.59 relative by step 30 here; 1e-3 in the pretraining demo): TP sums partial products in
    another order, and training amplifies the rounding. In fp64 the curves agree to ~1e-12, so the
    drift is rounding, not a difference in what the layouts compute."""
    from parallel_state import ParallelState
    reference = train_curve(ParallelState.single_process(), steps=LONG_STEPS, dtype=torch.float64)
    assert reference[-1][0] < 0.1 * reference[0][0], "the loss must fall far: a long, non-trivial run"
    layouts = [_layout(2, 1, 1, 1, 1, "allgather"), _layout(2, 1, 1, 2, 1, "allgather")]
    curves = run_on_ranks(_long_fp64_worker, 2, args=(layouts,), timeout_s=900)[0]
    for layout, curve in zip(layouts, curves):
        for step, (got, want) in enumerate(zip(curve, reference), start=1):
            for name, g, w in zip(("loss", "grad_norm", "aux_loss"), got, want):
                assert abs(g - w) <= FP64_REL_TOL * abs(w), f"{layout} step {step} {name}: {g!r} vs {w!r}"
