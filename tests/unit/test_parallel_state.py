"""Rank grid (pure, property-tested) and process-group construction (4 spawned gloo ranks)."""

from __future__ import annotations

from math import prod

import pytest
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

from parallel_state import (GROUP_KINDS, GroupInfo, ParallelState, compute_rank_groups, destroy_model_parallel,
                            initialize_model_parallel)
from tests.helpers.process_groups import _groups_by_ranks

TOKENS = ("tp", "cp", "ep", "dp", "pp")
# kind -> (grid, order tokens whose index varies inside one group); every other index is fixed.
VARYING = {
    "tp": ("dense", {"tp"}), "cp": ("dense", {"cp"}), "dp": ("dense", {"dp"}),
    "dp_cp": ("dense", {"dp", "cp"}), "pp": ("dense", {"pp"}), "mp": ("dense", {"tp", "pp"}),
    "ep": ("expert", {"ep"}), "etp": ("expert", {"tp"}), "edp": ("expert", {"dp"}),
    "ep_etp": ("expert", {"tp", "ep"}), "etp_edp": ("expert", {"tp", "dp"}),
    "tp_cp": ("dense", {"tp", "cp"}),
}


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def layouts(draw):
    world = draw(st.integers(1, 64))
    pp = draw(st.sampled_from(_divisors(world)))
    stage = world // pp
    tp = draw(st.sampled_from(_divisors(stage)))
    cp = draw(st.sampled_from(_divisors(stage // tp)))
    ep = draw(st.sampled_from(_divisors(stage)))
    etp = draw(st.sampled_from(_divisors(stage // ep)))
    order = "-".join(draw(st.permutations(TOKENS)))
    return world, dict(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, order=order)


def _coords(rank, sizes_by_token, tokens):
    """Grid index of ``rank`` per token, the leftmost token having stride 1."""
    coords, rest = {}, rank
    for t in tokens:
        coords[t], rest = rest % sizes_by_token[t], rest // sizes_by_token[t]
    return coords


# MoE parallel folding (the expert grid independent of the dense one: etp < tp, EP spanning TP ranks),
# always checked besides the drawn layouts.
FOLDING_LAYOUTS = [
    (4, dict(tp=2, pp=1, ep=4, etp=1, cp=1, order="tp-cp-ep-dp-pp")),
    (4, dict(tp=2, pp=1, ep=2, etp=1, cp=1, order="tp-cp-ep-dp-pp")),
    (16, dict(tp=4, pp=2, ep=4, etp=2, cp=1, order="tp-cp-ep-dp-pp")),
    (16, dict(tp=2, pp=1, ep=8, etp=1, cp=2, order="tp-cp-ep-dp-pp")),
    (24, dict(tp=6, pp=4, ep=3, etp=2, cp=1, order="tp-ep-dp-pp")),
]


@settings(max_examples=150, deadline=None)
@given(layouts())
@example(FOLDING_LAYOUTS[0])
@example(FOLDING_LAYOUTS[1])
@example(FOLDING_LAYOUTS[2])
@example(FOLDING_LAYOUTS[3])
@example(FOLDING_LAYOUTS[4])
def test_groups_partition_ranks_along_the_grid(layout):
    world, kw = layout
    tokens = kw["order"].split("-")
    dense = {"tp": kw["tp"], "cp": kw["cp"], "ep": 1, "dp": world // (kw["tp"] * kw["cp"] * kw["pp"]),
             "pp": kw["pp"]}
    expert = {"tp": kw["etp"], "cp": 1, "ep": kw["ep"],
              "dp": world // (kw["etp"] * kw["ep"] * kw["pp"]), "pp": kw["pp"]}
    pp_at = tokens.index("pp")
    pp_strides_differ = prod(dense[t] for t in tokens[:pp_at]) != prod(expert[t] for t in tokens[:pp_at])
    if kw["pp"] > 1 and pp_strides_differ:
        with pytest.raises(ValueError, match="different pp groups"):
            compute_rank_groups(world, **kw)
        return

    grid = compute_rank_groups(world, **kw)
    assert (grid.dp_size, grid.edp_size) == (dense["dp"], expert["dp"])
    grids = {"dense": dense, "expert": expert}
    for kind, (grid_name, varying) in VARYING.items():
        sizes = grids[grid_name]
        groups = getattr(grid, kind)
        members = [r for g in groups for r in g]
        assert sorted(members) == list(range(world)), f"{kind} groups must partition the ranks"
        for g in groups:
            assert list(g) == sorted(g)
            assert len(g) == prod(sizes[t] for t in varying)
            fixed = {tuple(v for t, v in _coords(r, sizes, tokens).items() if t not in varying)
                     for r in g}
            assert len(fixed) == 1, f"{kind} group {g} mixes grid positions"
    # The expert grid's pp index must match the dense grid's for every rank.
    for r in range(world):
        assert _coords(r, dense, tokens)["pp"] == _coords(r, expert, tokens)["pp"]
    if tokens[0] == "tp":
        assert all(g == tuple(range(g[0], g[0] + kw["tp"])) for g in grid.tp)
    assert grid.embedding == tuple((g[0], g[-1]) if kw["pp"] > 1 else g for g in grid.pp)
    for r in range(world):
        mine = grid.groups_of(r)
        assert set(mine["tp"]) & set(mine["dp"]) & set(mine["pp"]) == {r}
        assert set(mine["ep"]) & set(mine["etp"]) & set(mine["edp"]) == {r}
        assert set(mine["tp"]) | set(mine["pp"]) <= set(mine["mp"])
        assert set(mine["dp"]) | set(mine["cp"]) <= set(mine["dp_cp"])
        assert set(mine["tp"]) | set(mine["cp"]) <= set(mine["tp_cp"])
        assert (mine["embedding"] is not None) == (r in (mine["pp"][0], mine["pp"][-1]))


def test_world8_tp2_pp2_matches_megatron_layout():
    g = compute_rank_groups(8, tp=2, pp=2)
    assert g.tp == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert g.dp == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert g.dp_cp == g.dp
    assert g.pp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert g.mp == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert g.embedding == g.pp
    assert g.cp == g.etp == tuple((r,) for r in range(8))


def test_world16_tp2_pp4_matches_megatron_docstring():
    g = compute_rank_groups(16, tp=2, pp=4)
    assert g.tp == tuple((r, r + 1) for r in range(0, 16, 2))
    assert g.dp == ((0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15))
    assert g.pp == ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
    assert g.embedding == ((0, 12), (1, 13), (2, 14), (3, 15))
    assert g.groups_of(5)["embedding"] is None  # a middle stage
    assert g.groups_of(13)["embedding"] == (1, 13)


def test_folding_expert_groups_match_megatron_rank_generator_tables():
    """Megatron-Core's published group tables (as data), for the expert grid of a folding layout.

    The docstring of Megatron-Core's ``generate_masked_orthogonal_rank_groups`` (megatron/core/parallel_state.py,
    which ``RankGenerator.get_ranks`` calls) works the example parallel_size [2, 3, 4] with the second
    dim masked: group 0 = [0, 2, 4], group 1 = [1, 3, 5], ..., group 7 = [19, 21, 23]. Its expert
    ``RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order)`` with order "tp-ep-dp-pp", etp 2, ep 3,
    edp 1, pp 4 has those sizes, so its EP groups are that table, while the dense grid has tp 6.
    The same docstring's 8-rank example ('tp-pp-dp', sizes 2-2-2) gives dp groups [[0, 4], [1, 5],
    [2, 6], [3, 7]]."""
    g = compute_rank_groups(24, tp=6, pp=4, ep=3, etp=2, order="tp-ep-dp-pp")
    assert g.ep[0] == (0, 2, 4) and g.ep[1] == (1, 3, 5) and g.ep[7] == (19, 21, 23)
    assert len(g.ep) == 8
    assert g.etp[0] == (0, 1) and g.tp[0] == tuple(range(6))           # etp 2 folds inside tp 6
    assert g.pp[0] == (0, 6, 12, 18)
    g = compute_rank_groups(8, tp=2, pp=2, etp=2, order="tp-pp-dp")
    assert g.dp == g.edp == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_context_parallel_groups():
    g = compute_rank_groups(8, tp=2, cp=2)  # strides tp=1, cp=2, dp=4
    assert g.cp == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert g.dp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert g.dp_cp == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert g.tp_cp == ((0, 1, 2, 3), (4, 5, 6, 7))     # the ranks holding tokens of the same sequences
    assert g.mp == g.tp


def test_expert_parallel_spans_tp_and_dp_ranks():
    g = compute_rank_groups(8, tp=2, ep=4)  # expert grid: ep stride 1, edp=2 stride 4
    assert g.ep == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert g.edp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert g.etp == tuple((r,) for r in range(8))
    assert g.dp == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert (g.dp_size, g.edp_size) == (4, 2)


def test_expert_tensor_parallel_with_pp():
    g = compute_rank_groups(8, tp=2, pp=2, ep=2, etp=2)  # expert: etp 1, ep 2, edp=1, pp 4
    assert g.etp == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert g.ep == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert g.edp == tuple((r,) for r in range(8))


def test_pp_before_dp_is_fine_when_both_grids_agree():
    g = compute_rank_groups(8, tp=2, pp=2, ep=2, etp=2, order="tp-cp-pp-ep-dp")
    assert g.pp == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert g.ep == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert g.dp == g.ep
    assert g.order == "tp-cp-pp-ep-dp"


def test_omitted_size_one_tokens_are_appended():
    g = compute_rank_groups(4, tp=2, order="TP-DP")
    assert g.order == "tp-dp-cp-ep-pp"
    assert g.tp == ((0, 1), (2, 3))


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tp=4), r"world_size 6 is not divisible by tp\*cp\*pp = 4\*1\*1 = 4"),
    (dict(world_size=8, pp=2, ep=4, etp=2), r"ep\*etp must divide the ranks of a PP stage.*8 does not "
                                             r"divide world_size/pp = 8/2 = 4"),
    (dict(world_size=4, tp=0), "tp must be >= 1, got 0"),
    (dict(world_size=0), "world_size must be >= 1, got 0"),
    (dict(world_size=4, order="tp-xp-pp"), r"unknown token\(s\) \['xp'\]"),
    (dict(world_size=4, order="tp-dp-tp"), r"repeats token\(s\) \['tp'\]"),
    (dict(world_size=4, ep=2, order="tp-dp-pp"), "omits 'ep', whose size is 2"),
    (dict(world_size=8, tp=2, pp=2, ep=4, order="tp-pp-ep-dp"), "stride is 2 in the dense grid but 1"),
])
def test_invalid_layouts_name_the_numbers(kwargs, message):
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=message):
        compute_rank_groups(world, **kwargs)


def test_single_process_state_needs_no_distributed():
    state = ParallelState.single_process()
    for kind in GROUP_KINDS:
        assert getattr(state, kind) == GroupInfo(group=None, ranks=(0,), rank=0, size=1)
    assert state.is_first_pp_stage and state.is_last_pp_stage
    assert state.pp_prev_rank is None and state.pp_next_rank is None


def test_group_info_validates_itself():
    with pytest.raises(ValueError, match="size 2 != len"):
        GroupInfo(group=None, ranks=(0,), rank=0, size=2)
    with pytest.raises(ValueError, match="rank must be in"):
        GroupInfo(group=None, ranks=(3, 4), rank=2, size=2)
    with pytest.raises(ValueError, match="group=None"):
        GroupInfo(group=object(), ranks=(3,), rank=0, size=1)


def test_initialize_without_distributed_raises():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        initialize_model_parallel(tp=2)


def test_model_groups_keep_only_the_backend_of_the_model_device():
    from parallel_state.state import model_group_backend
    assert model_group_backend("cpu:gloo,cuda:nccl") == "cuda:nccl"      # no gloo context per group
    assert model_group_backend("cuda:nccl, cpu:gloo") == "cuda:nccl"
    for serves_every_device in ("gloo", "nccl", "cpu:fake,meta:fake", "some_plugin"):
        assert model_group_backend(serves_every_device) == serves_every_device


def test_groups_take_the_default_backend_when_it_serves_every_device():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=5, world_size=8)
    try:
        state = initialize_model_parallel(tp=2, ep=2, pp=2)
        for info in (state.tp, state.ep, state.pp, state.dp_cp):
            assert dist.get_backend(info.group) == dist.get_backend(), info
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()


COMMUNICATOR_LAYOUTS = [
    (8, dict(tp=2, pp=2, ep=2)),
    (8, dict(tp=2, ep=2)),
    (16, dict(tp=2, cp=2, pp=2, ep=4, etp=1)),
    (64, dict(tp=8, pp=2, ep=8)),
    (64, dict(tp=4, pp=4, ep=4, etp=2, cp=2)),
]


@pytest.mark.parametrize("world, layout", COMMUNICATOR_LAYOUTS)
def test_one_communicator_per_distinct_rank_set_with_only_the_device_backend(world, layout, monkeypatch):
    """The new_group calls of a CUDA job ("cpu:gloo,cuda:nccl", played over torch's fake process group):
    each distinct rank set of more than one rank once, with NCCL alone; kinds over the same ranks share the
    group. Before: one group per kind (13 kinds), each with a gloo and an NCCL backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    grid = compute_rank_groups(world, **layout)
    distinct = {ranks for kind in GROUP_KINDS for ranks in getattr(grid, kind) if len(ranks) > 1}
    per_kind = sum(len(ranks) > 1 for kind in GROUP_KINDS for ranks in getattr(grid, kind))
    assert len(distinct) < per_kind                     # the layouts above do share rank sets
    new_group, calls = dist.new_group, []

    def recording_new_group(ranks, backend=None, **kwargs):
        calls.append((tuple(ranks), backend))
        return new_group(ranks, backend="fake", **kwargs)   # a fake group stands in for the NCCL one

    rank = world - 1
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
        monkeypatch.setattr(dist, "new_group", recording_new_group)
        state = initialize_model_parallel(**layout)
        assert sorted(calls) == sorted((ranks, "cuda:nccl") for ranks in distinct), calls
        assert len(_groups_by_ranks(state)) == sum(rank in ranks for ranks in distinct)
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()
