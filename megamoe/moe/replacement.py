"""Movement-aware re-placement: a new placement for a new load that moves as few expert weights as possible.

Every slot whose expert changes must receive that expert's weights (and, in training, its optimizer
state) from another slot, so the cost of a rebalance is the number of changed slots.
:func:`replace_experts` is a pure, deterministic function of the current placement and the load, so every
EP rank computes the same update from the same reduced load, with no broadcast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from megamoe.moe.argument_checks import hierarchy, validated_load
from megamoe.moe.assignment import min_cost_assignment
from megamoe.moe.expert_slots import ExpertPlacement

__all__ = ["PlacementUpdate", "replace_experts"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacementUpdate:
    """The result of :func:`replace_experts` for one layer."""

    placement: ExpertPlacement  # the new placement (the current one itself when nothing changes)
    changed_slots: tuple[int, ...]  # global slot ids whose expert differs from the current placement, ascending
    balancedness_before: float  # the current placement under the new load
    balancedness_after: float  # the new placement under the new load

    @property
    def changed(self) -> bool:
        return bool(self.changed_slots)


def replace_experts(current: ExpertPlacement, expert_load, *, num_groups: int | None = None,
                    num_nodes: int | None = None, tolerance: float = 0.99) -> PlacementUpdate:
    """A placement for ``expert_load`` that reaches ``tolerance`` x the from-scratch balancedness
    (:meth:`ExpertPlacement.balanced`) while changing as few slots of ``current`` as possible.

    If ``current`` already serves the load that well, nothing changes. Otherwise the from-scratch
    placement's ranks are matched to the current ranks (maximum number of experts kept on their rank),
    and within a rank every expert that stays keeps its slot. ``num_groups`` / ``num_nodes``: the
    hierarchical policy, as in :meth:`ExpertPlacement.balanced` (replicas stay inside the node holding
    their group). Deterministic: ties go to lower indices.
    """
    if not isinstance(current, ExpertPlacement):
        raise ValueError(f"current must be an ExpertPlacement, got {type(current).__name__}")
    load = validated_load(expert_load, current.num_experts, "expert_load")
    num_groups, num_nodes = hierarchy(current.num_experts, current.ep_size, num_groups, num_nodes)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance <= 1:
        raise ValueError(f"tolerance must be a number in (0, 1], got {tolerance!r}")
    before = current.balancedness(load)
    scratch = ExpertPlacement.balanced(load, current.num_slots, current.ep_size,
                                       num_groups=None if num_nodes == 1 else num_groups,
                                       num_nodes=None if num_nodes == 1 else num_nodes)
    if before >= tolerance * scratch.balancedness(load) and _respects_nodes(current, num_groups, num_nodes):
        return PlacementUpdate(current, (), before, before)
    new = matched_to(current, scratch, num_nodes)
    return _update(current, new, load, before)


def _update(current: ExpertPlacement, new_table: list[int], load, before: float) -> PlacementUpdate:
    old_table = current.slot_to_expert.tolist()
    changed = tuple(s for s, (old, new) in enumerate(zip(old_table, new_table)) if old != new)
    if not changed:
        return PlacementUpdate(current, (), before, before)
    placement = ExpertPlacement(new_table, current.num_experts, current.ep_size)
    return PlacementUpdate(placement, changed, before, placement.balancedness(load))


def _respects_nodes(placement: ExpertPlacement, num_groups: int, num_nodes: int) -> bool:
    """Whether every group's slots lie in one node and every node holds the same number of whole groups."""
    if num_nodes == 1:
        return True
    experts_per_group = placement.num_experts // num_groups
    slots_per_node = placement.num_slots // num_nodes
    table = np.asarray(placement.slot_to_expert.tolist())
    node_of_slot = np.arange(placement.num_slots) // slots_per_node
    group_of_slot = table // experts_per_group
    nodes_of_group = [set(node_of_slot[group_of_slot == g].tolist()) for g in range(num_groups)]
    if any(len(nodes) != 1 for nodes in nodes_of_group):
        return False
    groups_per_node = np.bincount([next(iter(nodes)) for nodes in nodes_of_group], minlength=num_nodes)
    return bool((groups_per_node == num_groups // num_nodes).all())


def matched_to(current: ExpertPlacement, new: ExpertPlacement, num_nodes: int = 1) -> list[int]:
    """``new``'s slot table with its ranks relabelled to keep as many experts as possible on their rank
    (a rank's experts move together; nodes, blocks of ``ep_size / num_nodes`` ranks, move together too),
    and within each rank every expert that stays in its old slot.

    Rank contents are multisets of experts; keeping them on a rank that held them saves a transfer, so
    the relabelling maximises the summed multiset overlap: a minimum-cost assignment of nodes to nodes,
    each pair scored by the best assignment of its ranks.
    """
    ep, spr, num_experts = current.ep_size, current.slots_per_rank, current.num_experts
    old_ranks = np.asarray(current.slot_to_expert.tolist()).reshape(ep, spr)
    new_ranks = np.asarray(new.slot_to_expert.tolist()).reshape(ep, spr)
    old_counts = np.zeros((ep, num_experts), dtype=np.int64)
    new_counts = np.zeros((ep, num_experts), dtype=np.int64)
    np.add.at(old_counts, (np.repeat(np.arange(ep), spr), old_ranks.ravel()), 1)
    np.add.at(new_counts, (np.repeat(np.arange(ep), spr), new_ranks.ravel()), 1)
    overlap = np.minimum(new_counts[:, None, :], old_counts[None, :, :]).sum(axis=2)  # [new rank, old rank]

    rpn = ep // num_nodes
    node_score = np.zeros((num_nodes, num_nodes), dtype=np.int64)
    rank_matches = {}
    for new_node in range(num_nodes):
        for old_node in range(num_nodes):
            block = overlap[new_node * rpn:(new_node + 1) * rpn, old_node * rpn:(old_node + 1) * rpn]
            match = min_cost_assignment(-block)
            rank_matches[new_node, old_node] = match
            node_score[new_node, old_node] = sum(block[i, match[i]] for i in range(rpn))
    node_match = min_cost_assignment(-node_score)

    table = old_ranks.tolist()
    for new_node, old_node in enumerate(node_match):
        for i, j in enumerate(rank_matches[new_node, old_node]):
            new_rank, old_rank = new_node * rpn + i, old_node * rpn + j
            table[old_rank] = _kept_in_slot(old_ranks[old_rank].tolist(), new_ranks[new_rank].tolist())
    return [expert for rank in table for expert in rank]


def _kept_in_slot(old_slots: list[int], new_experts: list[int]) -> list[int]:
    """One rank's slots holding the multiset ``new_experts``: each expert already in a slot stays there
    (its first copies, in slot order), the rest fill the freed slots in ascending expert order."""
    remaining = {}
    for expert in new_experts:
        remaining[expert] = remaining.get(expert, 0) + 1
    slots = [None] * len(old_slots)
    for slot, expert in enumerate(old_slots):
        if remaining.get(expert, 0) > 0:
            slots[slot] = expert
            remaining[expert] -= 1
    arriving = iter(sorted(expert for expert, count in remaining.items() for _ in range(count)))
    return [expert if expert is not None else next(arriving) for expert in slots]
