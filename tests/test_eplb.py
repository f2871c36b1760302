"""Online expert rebalancing (EPLB, megamoe.moe.eplb) end to end: a placement never changes the function the
model computes, so training with rebalancing every 3 steps gives the loss curve of the run without it, and
greedy generation with rebalancing gives the same tokens, under a router biased so that the load is skewed
and slots really move; every rank computes the same placements (a forced mismatch raises); the next
checkpoint holds the new placements and resumes under another layout; the config, the load window and
the script flags are checked."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megamoe.inference.generation import GenerationConfig, generate
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.eplb import EPLBConfig, PlacementDivergenceError
from megamoe.moe.expert_load_window import ExpertLoadWindow
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.tensor_parallel import initialize_parameters
from megamoe.testing import run_on_ranks
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import AttentionConfig, RopeConfig

pytestmark = pytest.mark.usefixtures("one_thread")

H, V, E, SEQ, GLOBAL_BATCH, MICRO_BATCH, STEPS, INTERVAL = 32, 64, 8, 8, 8, 2, 15, 3
REL_TOL = 1e-6                  # fp32, over STEPS steps (the bound)
RESUME_REL_TOL = 1e-5           # another layout sums in another order (as tests/test_training.py)
# Selection bias of the skewed router: experts 3-5 take more tokens (each layer its own, rolled by the
# layer id); they share an EP rank under the default placement (experts in slot order) of every layout
# below, so the rebalancer has work to do.
SKEW = (0.0, 0.0, 0.0, 0.02, 0.06, 0.04, 0.0, 0.0)


def skewed_config(dispatcher: str, num_slots: int) -> GPTMoEConfig:
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=2,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  rope=RopeConfig(dim=8)),
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=E, top_k=2, norm_topk_prob=True,
                                          aux_loss_coeff=0.01, use_expert_bias=True, expert_bias_update_rate=0.02),
                      ffn_hidden_size=16, num_expert_slots=num_slots, dispatcher=dispatcher, expert_backend="torch"),
        moe_layer_ids=(0, 1))


def skewed_model(state, dispatcher: str, num_slots: int) -> GPTMoEModel:
    model = GPTMoEModel(skewed_config(dispatcher, num_slots), state)
    initialize_parameters(model, seed=0)
    for layer_id, layer in model.moe_layers().items():
        layer.router.expert_bias.copy_(torch.tensor(SKEW).roll(layer_id))    # each layer its own hot experts
    return model


def global_batch() -> torch.Tensor:
    return torch.randint(0, V, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))


def train(trainer: Trainer, state, steps: int) -> list:
    """``steps`` steps on this rank's share of the same global batch; per step (loss, grad norm, report)."""
    per_rank = GLOBAL_BATCH // state.dp_cp.size
    mine = global_batch()[state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
    out = []
    for _ in range(steps):
        m = trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO_BATCH)])
        out.append((m.loss, m.grad_norm, m.eplb))
    return out


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
        state = initialize_model_parallel(tp=layout["tp"], ep=layout["ep"], etp=layout["etp"])
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
            trained_placements = {i: l.placement.to_dict() for i, l in model.moe_layers().items()}
            identical = replicas_identical(model, trainer.optimizer)     # generation moves weights only
            prompts = [[1, 2, 3, 4], [5, 6, 7]]
            greedy = generate(model, state, prompts, GenerationConfig(max_new_tokens=8))
            with_eplb = generate(model, state, prompts, GenerationConfig(max_new_tokens=8),
                                 eplb=EPLBConfig(window=2, interval=2))
            run["eplb" if eplb else "plain"] = {
                "curve": [(loss, norm) for loss, norm, _ in steps],
                "reports": [r for _, _, r in steps if r is not None],
                "replicas_identical": identical,
                "tokens": (greedy.token_ids, with_eplb.token_ids),
                "generate_moved": sum(r.moved_slots + r.local_copies for r in with_eplb.eplb_reports),
                "placements": trained_placements,
            }
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
    import megamoe.moe.replacement as replacement
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
    destroy_model_parallel()
    return results, divergence, unchanged


def _layout(tp, ep, etp, dispatcher, slots):
    return dict(tp=tp, ep=ep, etp=etp, dispatcher=dispatcher, slots=slots)


# world 2: EP 2 with replicated slots (alltoall), EP 2 all-gather (inside TP 2) without replicas.
LAYOUTS_2 = [_layout(1, 2, 1, "alltoall", 12), _layout(2, 2, 1, "allgather", E)]
# world 4: EP 4 replicated (alltoall), EP 2 all-gather replicated (TP 2, DP 2), ETP 2 (TP 2, EP 2),
# expert-DP 2 (EP 2, DP 4).
LAYOUTS_4 = [_layout(1, 4, 1, "alltoall", 12), _layout(2, 2, 1, "allgather", 12),
             _layout(2, 2, 2, "alltoall", 12), _layout(1, 2, 1, "alltoall", 10)]


def _close(got, want, rel):
    return all(abs(g - w) <= rel * abs(w) + 1e-9 for g, w in zip(got, want))


@pytest.mark.slow
@pytest.mark.parametrize("world, layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)], ids=["world2", "world4"])
def test_rebalancing_keeps_the_loss_curve_and_the_tokens(world, layouts, tmp_path):
    per_rank = run_on_ranks(_layout_worker, world, args=(layouts, str(tmp_path / "ckpt")), timeout_s=600)
    results, divergence, unchanged = per_rank[0]
    for rank in range(world):     # every rank reports the same global metrics and rounds
        assert [{k: r[k]["curve"] for k in ("plain", "eplb")} for r in per_rank[rank][0]] == \
            [{k: r[k]["curve"] for k in ("plain", "eplb")} for r in results]
        assert per_rank[rank][1] is not None and "different new expert placements" in per_rank[rank][1]
        assert per_rank[rank][2], "a diverged round must leave every placement as it was"
    for layout, run in zip(layouts, results):
        plain, eplb = run["plain"], run["eplb"]
        assert [r.step for r in eplb["reports"]] == list(range(INTERVAL, STEPS + 1, INTERVAL)), layout
        assert plain["reports"] == [] and not plain["tokens"][0] == []
        moved = sum(r.moved_slots + r.local_copies for r in eplb["reports"])
        assert moved > 0, f"{layout}: the skewed load must move slots, else this test cannot fail"
        assert eplb["reports"][0].balancedness_after > eplb["reports"][0].balancedness_before, layout
        assert eplb["placements"] != plain["placements"], layout
        for step, (got, want) in enumerate(zip(eplb["curve"], plain["curve"]), start=1):
            assert _close(got, want, REL_TOL), f"{layout} step {step}: {got} vs {want}"
        assert eplb["replicas_identical"] and plain["replicas_identical"], layout
        for which in (plain, eplb):
            greedy, rebalanced = which["tokens"]
            assert rebalanced == greedy, f"{layout}: generation with rebalancing changed the tokens"
        assert plain["generate_moved"] > 0, f"{layout}: generation must move slots, else the check cannot fail"
    resumed = results[0]["resumed"]
    for step, (got, want) in enumerate(zip(resumed, results[0]["eplb"]["curve"][9:]), start=10):
        assert _close(got, want, RESUME_REL_TOL), f"resumed under EP 1, step {step}: {got} vs {want}"
    saved = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["expert_placement"]
    assert saved == results[0]["saved_placements"], "the checkpoint holds the placements of its step"
    assert saved != {str(i): p for i, p in results[0]["plain"]["placements"].items()}, \
        "the checkpoint after a rebalance holds the new placements"
