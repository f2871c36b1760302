"""Rank grid (pure, property-tested) and process-group construction (4 spawned gloo ranks).

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_parallel_state.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megamoe.spawned_ranks import run_on_ranks
from parallel_state import (GROUP_KINDS, compute_rank_groups, destroy_model_parallel, get_parallel_state,
                            initialize_model_parallel)
from tests.helpers.process_groups import _groups_by_ranks


def _check_layouts(rank, world_size, layouts_to_check):
    """On each rank: build each layout in turn, compare with the pure grid, reduce over every group."""
    reductions = 0
    for kw in layouts_to_check:
        state = initialize_model_parallel(**kw)
        assert get_parallel_state() is state
        try:
            initialize_model_parallel(**kw)
        except RuntimeError as err:
            assert "destroy_model_parallel" in str(err)
        else:
            raise AssertionError("a second initialize_model_parallel must raise")
        expected = compute_rank_groups(world_size, **kw).groups_of(rank)
        assert (state.rank, state.world_size) == (rank, world_size)
        for kind in GROUP_KINDS:
            info = getattr(state, kind)
            assert info.ranks == expected[kind], (kind, info.ranks, expected[kind])
            assert info.rank == expected[kind].index(rank)
            if info.size == 1:
                assert info.group is None
                continue
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=info.group)
            assert total.item() == sum(info.ranks), (kind, total.item(), info.ranks)
            reductions += 1
        _groups_by_ranks(state)
        pp_index = state.pp.rank
        assert state.pp_prev_rank == (state.pp.ranks[pp_index - 1] if pp_index > 0 else None)
        assert state.pp_next_rank == (state.pp.ranks[pp_index + 1] if pp_index < state.pp.size - 1
                                      else None)
        destroy_model_parallel()
    return reductions


@pytest.mark.slow
def test_process_groups_on_4_ranks():
    layouts_to_check = [dict(tp=2, ep=2), dict(pp=2, ep=2)]
    reductions = run_on_ranks(_check_layouts, 4, args=(layouts_to_check,), timeout_s=120)
    # Groups of more than one rank: tp2 ep2 -> tp, dp, dp_cp, mp, ep, edp, ep_etp, etp_edp, tp_cp;
    # pp2 ep2 -> dp, dp_cp, pp, mp, ep, ep_etp, embedding (edp = 4 / (ep*pp) = 1).
    assert reductions == [16] * 4
