"""Movement-aware re-placement: a new placement for a new load that moves as few expert weights as possible.

Every slot whose expert changes must receive that expert's weights (and, in training, its optimizer
state) from another slot, so the cost of a rebalance is the number of changed slots.
:func:`replace_experts` is a pure, deterministic function of the current placement and the load, so every
EP rank computes the same update from the same reduced load, with no broadcast.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass

import numpy as np

from megamoe.moe.argument_checks import hierarchy, validated_load
from megamoe.moe.assignment import min_cost_assignment
from megamoe.moe.expert_slots import ExpertPlacement
from megamoe.moe.placement_policy import nodes_of_groups
from megamoe.moe.replica_moves import ReplicaMoves

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
    """A placement for ``expert_load`` that reaches ``tolerance`` x the balancedness of the from-scratch
    placement (:meth:`ExpertPlacement.balanced`) while changing as few slots of ``current`` as it can.

    1. If ``current`` already serves the load within ``tolerance`` of a bound on what the from-scratch
       placement can reach (its heaviest rank carries at least the mean rank load, and at least the
       smallest possible largest share of one replica), nothing changes.
    2. Otherwise few-slot moves (:mod:`megamoe.moe.replica_moves`) lower the heaviest rank: a slot
       changes to another expert (replica counts follow the load) or two slots swap experts, the move
       lowering the peak most per slot moved first, until the bound of 1. is met.
    3. Only if that stalls short of the bound is the from-scratch placement computed: if ``current``
       or the result of 2. reaches ``tolerance`` x its balancedness, that placement is kept (nothing
       changes for ``current``); otherwise the from-scratch placement is used, its ranks matched to the
       current ones (most experts kept on their rank; :func:`matched_to`).

    Every expert that is not moved keeps its slot, so ``changed_slots`` is exactly what must be
    transferred. An unchanged load changes nothing: the result of a call is a fixed point of the next.
    ``num_groups`` / ``num_nodes``: the hierarchical policy, as in :meth:`ExpertPlacement.balanced`:
    moves stay inside a node, so each group's replicas stay in the node holding it; a ``current``
    placement whose groups are not each inside one node, or whose node holds too heavy groups to reach
    the bound, is re-packed (step 3). A pure, deterministic function of its arguments (ties go to lower
    indices, no BLAS reductions): every rank computes the same update from the same load.
    """
    if not isinstance(current, ExpertPlacement):
        raise ValueError(f"current must be an ExpertPlacement, got {type(current).__name__}")
    load = validated_load(expert_load, current.num_experts, "expert_load")
    num_groups, num_nodes = hierarchy(current.num_experts, current.ep_size, num_groups, num_nodes)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance <= 1:
        raise ValueError(f"tolerance must be a number in (0, 1], got {tolerance!r}")
    loads = load.numpy()
    before = current.balancedness(load)
    table = np.asarray(current.slot_to_expert.tolist(), dtype=np.int64)
    target_peak = peak_bound(loads, current.num_slots, current.ep_size, num_groups, num_nodes) / tolerance
    in_nodes = _respects_nodes(current, num_groups, num_nodes)
    searched = None
    if in_nodes:
        if _peak(table, loads, current.ep_size) <= target_peak:
            return PlacementUpdate(current, (), before, before)
        if _node_bound(table, loads, current.ep_size, num_nodes) <= target_peak:
            search = ReplicaMoves(table, loads, current.ep_size, num_nodes)
            search.lower_peak(target_peak, max_moves=current.num_slots)
            searched = search.table
            if _peak(searched, loads, current.ep_size) <= target_peak:
                return _update(current, searched.tolist(), load, before)
    # The bound was not reached: judge against the from-scratch placement itself.
    scratch = ExpertPlacement.balanced(load, current.num_slots, current.ep_size,
                                       num_groups=None if num_nodes == 1 else num_groups,
                                       num_nodes=None if num_nodes == 1 else num_nodes)
    good_enough = tolerance * scratch.balancedness(load)
    if in_nodes and before >= good_enough:
        return PlacementUpdate(current, (), before, before)
    options = [_update(current, matched_to(current, scratch, num_nodes), load, before)]
    if searched is not None:
        update = _update(current, searched.tolist(), load, before)
        if update.balancedness_after >= good_enough:
            options.insert(0, update)
    return min(options, key=lambda update: len(update.changed_slots))  # the first on a tie


def peak_bound(loads: np.ndarray, num_slots: int, ep_size: int, num_groups: int = 1, num_nodes: int = 1) -> float:
    """A lower bound on the heaviest rank's load under :meth:`ExpertPlacement.balanced` for ``loads``:
    the mean rank load, and the largest share of one replica when replica counts are chosen to make it
    smallest; with nodes, both per node, for the node assignment of groups that policy makes."""
    flat = loads.tolist()
    experts_per_group = len(flat) // num_groups
    ranks_per_node, slots_per_node = ep_size // num_nodes, num_slots // num_nodes
    bound = 0.0
    for groups in nodes_of_groups(flat, num_groups, num_nodes) if num_nodes > 1 else [[0]]:
        node_loads = [x for g in groups for x in flat[g * experts_per_group:(g + 1) * experts_per_group]]
        bound = max(bound, sum(node_loads) / ranks_per_node, _smallest_largest_share(node_loads, slots_per_node))
    return bound


def _node_bound(table: np.ndarray, loads: np.ndarray, ep_size: int, num_nodes: int) -> float:
    """:func:`peak_bound` for the node assignment of groups in ``table`` (infinite-free; flat: the same)."""
    if num_nodes == 1:
        return 0.0  # no node constraint: the bound does not depend on the table
    slots_per_node = table.shape[0] // num_nodes
    bound = 0.0
    for node in range(num_nodes):
        experts = np.unique(table[node * slots_per_node:(node + 1) * slots_per_node]).tolist()
        node_loads = [float(loads[e]) for e in experts]
        bound = max(bound, sum(node_loads) / (ep_size // num_nodes),
                    _smallest_largest_share(node_loads, slots_per_node))
    return bound


def _smallest_largest_share(loads: list[float], num_slots: int) -> float:
    """min over replica counts (>= 1 each, ``num_slots`` in all) of max load / count: each extra replica
    to the expert with the largest share (water-filling, optimal for this min-max)."""
    heap = [(-load, 1, expert) for expert, load in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(num_slots - len(loads)):
        _, count, expert = heapq.heappop(heap)
        heapq.heappush(heap, (-loads[expert] / (count + 1), count + 1, expert))
    return -heap[0][0]


def _peak(table: np.ndarray, loads: np.ndarray, ep_size: int) -> float:
    counts = np.bincount(table, minlength=loads.shape[0])
    return float((loads / np.maximum(counts, 1))[table].reshape(ep_size, -1).sum(axis=1).max())


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
