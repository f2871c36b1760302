"""Shared by the parallel_state tests of both tiers."""

from parallel_state import GROUP_KINDS


def _groups_by_ranks(state) -> dict:
    """Rank set -> the process group of this rank's kinds over it, checking that kinds over the same ranks
    hold the same group (one communicator per distinct rank set, issue 29 row 14)."""
    by_ranks = {}
    for kind in GROUP_KINDS:
        info = getattr(state, kind)
        if info is not None and info.group is not None:
            assert by_ranks.setdefault(info.ranks, info.group) is info.group, kind
    return by_ranks
