"""Rank layout and process groups for tensor, pipeline, context, data and expert parallelism.

:mod:`parallel_state.rank_grid` computes which ranks share a group (pure, no torch.distributed);
:mod:`parallel_state.state` creates the process groups and returns a frozen :class:`ParallelState`
that scripts pass down to layers explicitly.
"""

from .rank_grid import DEFAULT_ORDER, GROUP_KINDS, RankGroups, compute_rank_groups
from .state import (
    GroupInfo,
    ParallelState,
    destroy_model_parallel,
    get_parallel_state,
    initialize_model_parallel,
)

__all__ = [
    "DEFAULT_ORDER",
    "GROUP_KINDS",
    "GroupInfo",
    "ParallelState",
    "RankGroups",
    "compute_rank_groups",
    "destroy_model_parallel",
    "get_parallel_state",
    "initialize_model_parallel",
]
