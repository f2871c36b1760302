"""Online expert rebalancing (EPLB, megamoe.moe.placement.eplb) end to end: a placement never changes the function the
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
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.placement.eplb import EPLBConfig, PlacementDivergenceError
from megamoe.moe.placement.expert_load_window import ExpertLoadWindow
from megamoe.moe.router import RouterConfig
from megamoe.spawned_ranks import run_on_ranks
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import AttentionConfig, RopeConfig

pytestmark = pytest.mark.usefixtures("one_thread")

H, V, E, SEQ, GLOBAL_BATCH, MICRO_BATCH, STEPS, INTERVAL = 32, 64, 8, 8, 8, 2, 15, 3
REL_TOL = 1e-6                  # fp32, over STEPS steps (the bound)
RESUME_REL_TOL = 1e-5           # another layout sums in another order (as tests/test_training.py)
EXPERT_BYTES = 3 * 16 * H * 4     # gate, up [F, H] and down [H, F] in fp32, F = 16
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


# ---- in-process checks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"window": 0}, "window"), ({"interval": 0}, "interval"), ({"interval": 2.5}, "interval"),
    ({"balancedness_threshold": 0.0}, "balancedness_threshold"),
    ({"balancedness_threshold": 1.5}, "balancedness_threshold"),
    ({"max_layers_per_round": 0}, "max_layers_per_round"), ({"num_groups": 2}, "num_groups and num_nodes"),
    ({"num_groups": 0, "num_nodes": 1}, "num_groups")])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"EPLBConfig.{field}"):
        EPLBConfig(**kwargs)


def test_configs_that_do_not_fit_the_model_are_refused():
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    model = skewed_model(state, "alltoall", E)
    with pytest.raises(ValueError, match="TrainConfig.eplb must be an EPLBConfig"):
        TrainConfig(eplb={"interval": 3})
    with pytest.raises(ValueError, match="num_groups=3, num_nodes=1 do not fit 8 experts"):
        Trainer(model, state, TrainConfig(eplb=EPLBConfig(num_groups=3, num_nodes=1)))
    with pytest.raises(ValueError, match=r"compiled=True\) cannot rebalance experts"):
        generate(model, state, [[1, 2]], GenerationConfig(max_new_tokens=2), compiled=True, eplb=EPLBConfig())


def test_load_window_sums_the_last_window_records_on_the_device():
    window = ExpertLoadWindow(3, num_layers=2, num_experts=4)
    records = [torch.randint(0, 100, (2, 4), generator=torch.Generator().manual_seed(i)) for i in range(5)]
    for count, record in enumerate(records, start=1):
        window.record(record)
        assert torch.equal(window.total(), torch.stack(records[max(0, count - 3):count]).sum(0))
        assert window.filled == min(count, 3)
    assert window.buffer.dtype == torch.int64 and window.buffer.shape == (3, 2, 4)
    with pytest.raises(ValueError, match=r"\[num_layers, num_experts\] = \[2, 4\]"):
        window.record(torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer token counts"):
        window.record(torch.zeros(2, 4))
    window.reset()
    assert window.filled == 0 and not window.total().any()


def _step_lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_pretrain_script_rebalances_logs_each_round_and_resumes_with_the_placement(demo, tmp_path, capsys,
                                                                                   monkeypatch):
    from megamoe.cli.launch import run_script
    from megamoe.moe.placement.expert_slots import ExpertPlacement
    from megamoe.training.checkpoint import expert_placements_from_checkpoint, latest_checkpoint
    argv = ["--work-dir", tmp_path / "work", "--save-dir", tmp_path / "ckpt", "--corpus-bytes", "100000",
            "--vocab-size", "512", "--hidden", "32", "--layers", "2", "--sample-tokens", "0", "--steps", "4",
            "--global-batch", "4", "--seq-len", "16", "--num-expert-slots", "12",
            "--save-every", "4", "--eplb-interval", "2", "--eplb-window", "3", "--eplb-threshold", "0.9",
            "--eplb-max-layers", "1"]
    # The first run starts from a placement of its own (as one a rebalance reached on more EP ranks):
    # the resumed run must keep it, not fall back to the default one.
    reached = ExpertPlacement([7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4], 8, 1)
    build_placements = demo.build_placements
    monkeypatch.setattr(demo, "build_placements", lambda config, ep, **kw: {i: reached for i in config.moe_layer_ids})
    assert run_script(demo.main, [str(a) for a in argv], prog=demo.PROG) == 0
    monkeypatch.setattr(demo, "build_placements", build_placements)
    assert run_script(demo.main, [str(a) for a in [*argv, "--steps", "6", "--save-every", "6"]], prog=demo.PROG) == 0
    resumed = expert_placements_from_checkpoint(latest_checkpoint(tmp_path / "ckpt"))
    assert set(resumed.values()) == {reached} and len(resumed) == 1
    lines = _step_lines(tmp_path / "work" / "log.jsonl")
    rounds = [line for line in lines if "eplb_moved_slots" in line]
    assert [line["step"] for line in rounds] == [2, 4, 6]
    for line in rounds:     # one EP rank: always balanced, nothing moves
        assert line["eplb_moved_slots"] == 0 and line["eplb_moved_bytes"] == 0 and line["eplb_layers"] == []
        assert line["balancedness_before"] == line["balancedness_after"] == 1.0
    assert all("eplb" not in line for line in lines if "loss" in line), "a round has its own line"
    bad = [(["--eplb-interval", "0"], "--eplb-interval must be an int >= 1"),
           (["--eplb-interval", "2", "--eplb-threshold", "1.5"], "--eplb-threshold must be a number in (0, 1]"),
           (["--eplb-window", "3"], "--eplb-window need --eplb-interval N")]
    capsys.readouterr()
    for extra, fragment in bad:
        code = run_script(demo.main, [str(a) for a in [*argv[:4], "--work-dir", tmp_path / "w2", *extra]],
                          prog=demo.PROG)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1 and err[0].startswith("pretrain_moe.py: error: ") and fragment in err[0], err
        assert not (tmp_path / "w2").exists(), "the error must come before any work"


def test_a_skipped_step_records_no_load_and_does_not_rebalance():
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    model = skewed_model(state, "alltoall", E)
    trainer = Trainer(model, state, TrainConfig(lr=1e-2, eplb=EPLBConfig(window=2, interval=1)))
    weight = next(model.parameters())
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.fill_(float("nan"))
    skipped = train(trainer, state, 1)[0]
    assert trainer.consecutive_skips == 1 and skipped[2] is None and trainer.rebalancer.window.recorded == 0
    with torch.no_grad():
        weight.copy_(saved)
    report = train(trainer, state, 1)[0][2]
    assert report is not None and report.step == 2 and trainer.rebalancer.window.recorded == 1
