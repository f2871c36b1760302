"""The layout planner builds one model per rank role: its plans equal those of one model per rank (the
reference), on layouts with TP, PP, folding (etp != tp), replicas, balanced placements, the all-gather
dispatcher, and grids with context and data parallelism; the tiling check's grid fast path agrees with
the pairwise check."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megamoe.checkpoint.chunk_regions import _check_tiling, _is_grid
from megamoe.checkpoint.errors import CheckpointError, ConversionError
from megamoe.checkpoint.layout import ParallelLayout
from megamoe.checkpoint.layout_plan import _ep_peer_chunks, _groups_by_rank, _roles, plan_grid, plan_layout
from megamoe.checkpoint.placements import build_placements
from megamoe.models.families import config_from_hf
from megamoe.moe.placement.expert_slots import ExpertPlacement
from parallel_state import compute_rank_groups
from tests.helpers.hf_models import hf_config

# (family, tp, pp, ep, etp, expert slots, dispatcher); E = 8 experts.
LAYOUTS = [
    ("deepseek_v3", 2, 1, 1, 2, None, "alltoall"),      # TP only: experts cut by ETP
    ("deepseek_v3", 2, 2, 2, 1, 12, "alltoall"),        # folding, PP, replicas
    ("deepseek_v3", 1, 2, 4, 1, 16, "alltoall"),        # two slots per expert
    ("deepseek_v3", 2, 2, 2, 2, None, "alltoall"),      # EP over the DP ranks, experts cut by ETP
    ("qwen3_moe", 2, 2, 4, 1, 12, "alltoall"),          # GQA, tied embeddings on both PP ends
    ("qwen2_moe", 2, 1, 2, 1, None, "allgather"),       # EP inside the TP group
]


def _config(family, slots, dispatcher):
    return config_from_hf(hf_config(family), num_expert_slots=slots, dispatcher=dispatcher)


def _grid(layout: ParallelLayout, world=None, cp=1):
    return compute_rank_groups(world or layout.world_size, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp,
                               cp=cp)


@pytest.mark.parametrize("family,tp,pp,ep,etp,slots,dispatcher", LAYOUTS,
                         ids=[f"{f}-tp{t}-pp{p}-ep{e}-etp{x}-s{s}-{d}" for f, t, p, e, x, s, d in LAYOUTS])
def test_one_model_per_role_gives_the_plan_of_one_model_per_rank(family, tp, pp, ep, etp, slots, dispatcher):
    config = _config(family, slots, dispatcher)
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp)
    placements = build_placements(config, ep)
    plan = plan_layout(config, layout, placements)
    assert plan.tensors == plan_grid(config, _grid(layout), placements, every_rank=True)
    # Every expert of every MoE layer, cut by ETP: nothing an EP peer holds is missing.
    for layer in config.moe_layer_ids:
        for expert in range(config.moe.num_experts):
            assert len(plan.tensors[f"layers.{layer}.mlp.experts.{expert}.down_proj.weight"].regions) == etp


def test_balanced_placements_with_replicas_on_one_rank():
    config = _config("deepseek_v3", 12, "alltoall")
    layout = ParallelLayout(tp=2, pp=1, ep=2, etp=1)
    load = torch.tensor([40.0, 1, 1, 1, 1, 1, 1, 30])         # hot experts 0 and 7 get the spare slots
    placements = {layer: ExpertPlacement.balanced(load, 12, 2) for layer in config.moe_layer_ids}
    assert any(p.replica_counts.max() > 1 for p in placements.values())
    assert plan_layout(config, layout, placements).tensors == plan_grid(config, _grid(layout), placements,
                                                                        every_rank=True)


def test_context_and_data_parallel_copies_change_no_chunk():
    config = _config("deepseek_v3", 12, "alltoall")
    layout = ParallelLayout(tp=2, pp=2, ep=4, etp=1)
    placements = build_placements(config, 4)
    smallest = plan_layout(config, layout, placements).tensors
    grid = _grid(layout, world=16, cp=2)            # cp 2 x dp 2 per (tp, pp) position, ep 4 x edp 2 per stage
    assert plan_grid(config, grid, placements) == smallest
    assert plan_grid(config, grid, placements, every_rank=True) == smallest


def test_roles_are_pp_tp_etp_positions_spanning_their_ep_ranks():
    # tp 2, ep 4, etp 1, pp 2: 8 ranks; on each stage the tp position fixes ep parity (ep runs over the TP ranks).
    grid = compute_rank_groups(8, tp=2, pp=2, ep=4, etp=1)
    assert _roles(grid, _groups_by_rank(grid)) == {0: (2,), 1: (3,), 4: (2,), 5: (3,)}
    # tp 2 = etp 2, ep 2: ranks differ in ep only in pairs.
    grid = compute_rank_groups(4, tp=2, ep=2, etp=2)
    assert _roles(grid, _groups_by_rank(grid)) == {0: (1,), 1: (1,)}
    # With cp and dp the planned ranks stay one per (pp, tp, etp).
    grid = compute_rank_groups(16, tp=2, pp=2, ep=2, etp=1, cp=2)
    assert len(_roles(grid, _groups_by_rank(grid))) == 4


def test_a_layer_whose_experts_differ_is_refused_rather_than_guessed():
    placement = ExpertPlacement.default(4, 4, 2)
    layer = SimpleNamespace(placement=placement, local_slots=placement.local_slots(0))
    gate = ("layers.1.mlp.experts.{}.gate_proj.weight", (8, 4), (0, 0), (8, 4))
    down = ("layers.1.mlp.experts.{}.down_proj.weight", (4, 8), (0, 0), (4, 8))
    chunks = [(gate[0].format(0), *gate[1:]), (down[0].format(0), *down[1:]), (gate[0].format(1), *gate[1:])]
    with pytest.raises(ConversionError, match="do not all have the same chunks"):
        _ep_peer_chunks(layer, "layers.1.mlp.", chunks, (1,))
    chunks.append((down[0].format(1), *down[1:]))
    assert sorted(c[0] for c in _ep_peer_chunks(layer, "layers.1.mlp.", chunks, (1,))) == sorted(
        p.format(e) for e in (2, 3) for p in (gate[0], down[0]))


def test_an_impossible_layout_still_names_the_models_objection():
    config = _config("deepseek_v3", None, "alltoall")
    with pytest.raises(ConversionError, match="impossible for this model"):
        plan_layout(dataclasses.replace(config, num_layers=3), ParallelLayout(tp=8), build_placements(config, 1))


GRIDS = {
    "grid 2x2": ([((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], True, None),
    "uneven rows": ([((0, 0), (1, 4)), ((1, 0), (3, 4))], True, None),
    "not a grid, still a tiling": ([((0, 0), (2, 4)), ((2, 0), (2, 1)), ((2, 1), (2, 3))], False, None),
    "overlap": ([((0, 0), (3, 4)), ((2, 0), (2, 4))], False, "overlap"),
    "gap": ([((0, 0), (2, 4)), ((3, 0), (1, 4))], False, "cover"),
    "twice": ([((0, 0), (4, 4)), ((0, 0), (4, 4))], False, "overlap"),
}


@pytest.mark.parametrize("name", list(GRIDS))
def test_the_grid_fast_path_agrees_with_the_pairwise_tiling_check(name):
    regions, grid, error = GRIDS[name]
    assert _is_grid((4, 4), regions) == grid
    if error is None:
        _check_tiling("w", (4, 4), regions, "the chunks")
    else:
        with pytest.raises(CheckpointError, match=error):
            _check_tiling("w", (4, 4), regions, "the chunks")
