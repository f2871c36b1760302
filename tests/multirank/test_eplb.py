"""Online expert rebalancing (EPLB, megamoe.moe.placement.eplb) end to end: a placement never changes the function the
model computes, so training with rebalancing every 3 steps gives the loss curve of the run without it, and
greedy generation with rebalancing gives the same tokens, under a router biased so that the load is skewed
and slots really move; every rank computes the same placements (a forced mismatch raises); the next
checkpoint holds the new placements and resumes under another layout; the config, the load window and
the script flags are checked."""

import json

import pytest
import torch
import torch.distributed as dist

from megamoe.inference.generation import GenerationConfig, generate
from megamoe.moe.placement.eplb import EPLBConfig, PlacementDivergenceError
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training.trainer import TrainConfig, Trainer
from tests.helpers.eplb import E, H, INTERVAL, STEPS, skewed_model, train

pytestmark = pytest.mark.usefixtures("one_thread")
REL_TOL = 1e-6                  # fp32, over STEPS steps (the bound)
RESUME_REL_TOL = 1e-5           # another layout sums in another order (as tests/multirank/test_training.py)
EXPERT_BYTES = 3 * 16 * H * 4     # gate, up [F, H] and down [H, F] in fp32, F = 16


def replicas_identical(model, optimizer) -> bool:
    """Every slot of one expert holds bit-identical weights and Adam moments (this rank's slots)."""
    for layer in model.moe_layers().values():
        by_expert: dict[int, list[int]] = {}
        for local, slot in enumerate(layer.local_slots):
            by_expert.setdefault(int(layer.placement.slot_to_expert[slot]), []).append(local)
        for locals_ in by_expert.values():
            for param in layer.experts.parameters():
                tensors = [param.data] + [v for v in optimizer.state[param].values() if v.shape == param.shape]
                if any(not torch.equal(t[locals_[0]], t[i]) for t in tensors for i in locals_[1:]):
                    return False
    return True


def _layout_worker(rank, world_size, layouts, checkpoint_dir):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint
    results = []
    for index, layout in enumerate(layouts):
        state = initialize_model_parallel(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], etp=layout["etp"])
        run = {}
        for eplb in (None, EPLBConfig(window=4, interval=INTERVAL)):
            model = skewed_model(state, layout["dispatcher"], layout["slots"])
            trainer = Trainer(model, state, TrainConfig(lr=1e-2, eplb=eplb), world_group=dist.group.WORLD)
            save_at = 9 if (eplb is not None and index == 0) else None
            steps = train(trainer, state, save_at or STEPS)
            if save_at:
                save_training_checkpoint(checkpoint_dir, trainer, sampler_state=None, world_group=dist.group.WORLD)
                run["saved_placements"] = {str(i): l.placement.to_dict() for i, l in model.moe_layers().items()}
                steps += train(trainer, state, STEPS - save_at)
            if eplb is not None:   # the same load again: the placement is a fixed point, nothing moves
                trainer.rebalancer.rebalance(STEPS)
                run["again"] = trainer.rebalancer.rebalance(STEPS)
            trained = {"curve": [(loss, norm) for loss, norm, _ in steps],
                       "reports": [r for _, _, r in steps if r is not None],
                       "replicas_identical": replicas_identical(model, trainer.optimizer),
                       "placements": {i: l.placement.to_dict() for i, l in model.moe_layers().items()}}
            if eplb is None:       # greedy generation of the trained model, without and with rebalancing
                prompts = [[1, 2, 3, 4], [5, 6, 7]]
                greedy = generate(model, state, prompts, GenerationConfig(max_new_tokens=8))
                rebalanced = generate(model, state, prompts, GenerationConfig(max_new_tokens=8),
                                      eplb=EPLBConfig(window=2, interval=2))
                trained["tokens"] = (greedy.token_ids, rebalanced.token_ids)
                if index == 0:     # data-parallel attention: each rank its own requests, their loads summed
                    mine = [[1 + rank, 2, 3], [4, 5 + 2 * rank]]
                    ids = [2 * rank, 2 * rank + 1]
                    alone = generate(model, state, mine, GenerationConfig(max_new_tokens=6), request_ids=ids)
                    shared = generate(model, state, mine, GenerationConfig(max_new_tokens=6), request_ids=ids,
                                      eplb=EPLBConfig(window=2, interval=2), data_parallel_attention=True)
                    trained["dp_attention"] = (alone.token_ids, shared.token_ids, shared.eplb_reports)
                trained["generate_reports"] = rebalanced.eplb_reports
            run["eplb" if eplb else "plain"] = trained
        if index == 0:      # the rebalanced checkpoint, resumed under another layout (EP 1, no EPLB)
            destroy_model_parallel()
            state = initialize_model_parallel(tp=1, ep=1, etp=1)
            trainer = Trainer(skewed_model(state, "alltoall", E), state, TrainConfig(lr=1e-2),
                              world_group=dist.group.WORLD)
            load_training_checkpoint(checkpoint_dir, trainer, world_group=dist.group.WORLD)
            run["resumed"] = [(loss, norm) for loss, norm, _ in train(trainer, state, STEPS - 9)]
        results.append(run)
        destroy_model_parallel()
    # Every rank must compute the same placement: one rank's policy disagrees -> every rank raises.
    state = initialize_model_parallel(tp=1, ep=world_size, etp=1)
    import megamoe.moe.placement.replacement as replacement
    if rank == world_size - 1:
        honest = replacement.replace_experts

        def dishonest(current, load, **kwargs):
            update = honest(current, load, **kwargs)
            table = update.placement.slot_to_expert.flip(0)
            return type(update)(type(current)(table, current.num_experts, current.ep_size),
                                update.changed_slots, update.balancedness_before, update.balancedness_after)
        replacement.replace_experts = dishonest
    trainer = Trainer(skewed_model(state, "alltoall", E), state, TrainConfig(lr=1e-2, eplb=EPLBConfig(1, 1)),
                      world_group=dist.group.WORLD)
    before = {i: l.placement for i, l in trainer.model.moe_layers().items()}
    try:
        train(trainer, state, 1)
        divergence = None
    except PlacementDivergenceError as error:
        divergence = str(error)
    unchanged = all(l.placement == before[i] for i, l in trainer.model.moe_layers().items())
    # Placements that already differ between ranks (one set on rank 0 only) are caught the same way.
    if rank == world_size - 1:
        replacement.replace_experts = honest
    if rank == 0:
        layer = trainer.model.moe_layers()[0]
        layer.placement = type(layer.placement)(layer.placement.slot_to_expert.flip(0), E, world_size)
    try:
        trainer.rebalancer.rebalance(1)
        divergence = (divergence, None)
    except PlacementDivergenceError as error:
        divergence = (divergence, str(error))
    destroy_model_parallel()
    return results, divergence, unchanged


def _layout(tp, ep, etp, dispatcher, slots, pp=1):
    return dict(tp=tp, pp=pp, ep=ep, etp=etp, dispatcher=dispatcher, slots=slots)


# On 4 ranks, in one spawn: EP 4 with replicated slots (all-to-all); EP 2 all-gather inside TP 2, which
# makes expert-DP 2 (DP 2); ETP 2 (TP 2, EP 2, all-to-all), replicated too; 2 pipeline stages of EP 2
# (each stage re-places its own layer, from the loads and placements of both).
LAYOUTS = [_layout(1, 4, 1, "alltoall", 12), _layout(2, 2, 1, "allgather", 12), _layout(2, 2, 2, "alltoall", 10),
           _layout(1, 2, 1, "alltoall", 12, pp=2)]
WORLD = 4


def _close(got, want, rel):
    return all(abs(g - w) <= rel * abs(w) + 1e-9 for g, w in zip(got, want))


@pytest.mark.slow
def test_rebalancing_keeps_the_loss_curve_and_the_tokens(tmp_path):
    world, layouts = WORLD, LAYOUTS
    per_rank = run_on_ranks(_layout_worker, world, args=(layouts, str(tmp_path / "ckpt")), timeout_s=600)
    results, divergence, unchanged = per_rank[0]
    for rank in range(world):     # every rank reports the same global metrics and rounds
        assert [{k: r[k]["curve"] for k in ("plain", "eplb")} for r in per_rank[rank][0]] == \
            [{k: r[k]["curve"] for k in ("plain", "eplb")} for r in results]
        for error in per_rank[rank][1]:     # a rank computed another placement; a rank held another one
            assert error is not None and "different expert placements for MoE layer(s) [0" in error
        assert per_rank[rank][2], "a diverged round must leave every placement as it was"
    for layout, run in zip(layouts, results):
        plain, eplb = run["plain"], run["eplb"]
        assert [r.step for r in eplb["reports"]] == list(range(INTERVAL, STEPS + 1, INTERVAL)), layout
        assert plain["reports"] == []
        moved = sum(r.moved_slots + r.local_copies for r in eplb["reports"])
        assert moved > 0, f"{layout}: the skewed load must move slots, else this test cannot fail"
        assert eplb["reports"][0].balancedness_after > eplb["reports"][0].balancedness_before, layout
        assert eplb["placements"] != plain["placements"], layout
        for step, (got, want) in enumerate(zip(eplb["curve"], plain["curve"]), start=1):
            assert _close(got, want, REL_TOL), f"{layout} step {step}: {got} vs {want}"
        assert eplb["replicas_identical"] and plain["replicas_identical"], layout
        greedy, rebalanced = plain["tokens"]
        assert rebalanced == greedy, f"{layout}: generation with rebalancing changed the tokens"
        generated = plain["generate_reports"]
        assert sum(r.moved_slots for r in generated) > 0, f"{layout}: generation must move slots, else this cannot fail"
        # Bytes sent = slots moved x an expert's bytes (weights; in training + Adam's two moments), once per
        # expert-DP replica of the EP group (ETP ranks each send their shard).
        edp = world // (layout["ep"] * layout["etp"] * layout["pp"])
        for report in eplb["reports"]:
            assert report.moved_bytes == report.moved_slots * 3 * EXPERT_BYTES * edp, (layout, report)
        for report in generated:
            assert report.moved_bytes == report.moved_slots * EXPERT_BYTES * edp, (layout, report)
        assert run["again"].moved_slots == run["again"].local_copies == run["again"].moved_bytes == 0, layout
    for rank in range(world):
        alone, shared, reports = per_rank[rank][0][0]["plain"]["dp_attention"]
        assert shared == alone and len(reports) == 2, f"rank {rank}: data-parallel attention with rebalancing"
        assert sum(r.moved_slots for r in reports) > 0, "data-parallel attention: slots must move"
    resumed = results[0]["resumed"]
    for step, (got, want) in enumerate(zip(resumed, results[0]["eplb"]["curve"][9:]), start=10):
        assert _close(got, want, RESUME_REL_TOL), f"resumed under EP 1, step {step}: {got} vs {want}"
    saved = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["expert_placement"]
    assert saved == results[0]["saved_placements"], "the checkpoint holds the placements of its step"
    assert saved != {str(i): p for i, p in results[0]["plain"]["placements"].items()}, \
        "the checkpoint after a rebalance holds the new placements"
