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

from megamoe.moe.placement.argument_checks import hierarchy, validated_load
from megamoe.moe.placement.assignment import min_cost_assignment
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.moe.placement.placement_policy import nodes_of_groups, replica_counts
from megamoe.moe.placement.replica_moves import ReplicaMoves, filled_slots

__all__ = ["PlacementUpdate", "replace_experts", "peak_bound", "matched_to"]

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
                    num_nodes: int | None = None, tolerance: float = 0.99,
                    compare_to_scratch: bool = False) -> PlacementUpdate:
    """A placement for ``expert_load`` close to the best balance, changing as few slots of ``current``
    as it can. Every expert not moved keeps its slot, so ``changed_slots`` is exactly what to transfer.

    1. Target: ``tolerance`` x a bound on the balancedness a placement from scratch
       (:meth:`ExpertPlacement.balanced`) can reach (:func:`peak_bound`: its heaviest rank carries at
       least the mean rank load, and at least the smallest possible largest share of one replica). If
       ``current`` meets it, nothing changes.
    2. Few-slot moves from ``current`` (:mod:`megamoe.moe.placement.replica_moves`): one slot changes to another
       expert (replica counts follow the load) or two slots on different ranks swap experts; the move
       lowering the ranks' excess over the target most per slot moved first, until the target is met.
       Where one replica alone is over the target (the hot experts changed), the replica counts are set
       to the from-scratch policy's first (surplus slots to the experts short of replicas).
    3. The bound is not always reachable: where no move is left short of it, the moves stop at their
       first step within ``tolerance`` of the best they reached; if ``current`` is, nothing changes.

    With ``compare_to_scratch``, the from-scratch placement itself is the reference wherever the bound
    does not settle it (~0.1 s a layer at 256 experts, 288 slots, EP 32): nothing changes if ``current``
    is within ``tolerance`` of its balancedness, the moves stop as soon as they are, and if they cannot
    get there the from-scratch placement is used, its ranks matched to the current ones
    (:func:`matched_to`).

    ``num_groups`` / ``num_nodes``: the hierarchical policy, as in :meth:`ExpertPlacement.balanced`;
    moves stay inside a node, so each group's replicas stay in the node holding it. When the current
    node assignment of groups cannot reach the target, groups are swapped between nodes (fewest
    first): the arriving groups take the leaving groups' slots, every other slot stays; where the
    moves stall, the heaviest node is re-packed from scratch (ranks matched) if that is lighter. A
    ``current`` placement whose groups do not each lie in one node is re-packed from scratch (matched).

    A pure, deterministic function of its arguments (ties go to lower indices; elementwise numpy, no
    BLAS): every rank computes the same update from the same load. A second call with the same load
    changes nothing, as the search resumes where the first stopped (tested; a rare result of the
    re-counting paths can still improve by more than the tolerance).
    """
    if not isinstance(current, ExpertPlacement):
        raise ValueError(f"current must be an ExpertPlacement, got {type(current).__name__}")
    load = validated_load(expert_load, current.num_experts, "expert_load")
    num_groups, num_nodes = hierarchy(current.num_experts, current.ep_size, num_groups, num_nodes)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance <= 1:
        raise ValueError(f"tolerance must be a number in (0, 1], got {tolerance!r}")
    if not isinstance(compare_to_scratch, bool):
        raise ValueError(f"compare_to_scratch must be True or False, got {compare_to_scratch!r}")
    ep, num_slots = current.ep_size, current.num_slots
    loads = load.numpy()
    before = current.balancedness(load)
    unchanged = PlacementUpdate(current, (), before, before)
    table = np.asarray(current.slot_to_expert.tolist(), dtype=np.int64)
    target_peak = peak_bound(loads, num_slots, ep, num_groups, num_nodes) / tolerance
    in_nodes = _groups_in_nodes(table, current.num_experts, num_groups, num_nodes)
    if in_nodes and _peak(table, loads, ep) <= target_peak:
        return unchanged
    scratch = _Scratch(loads, num_slots, ep, num_groups, num_nodes)
    if compare_to_scratch:  # the reference is the from-scratch placement: a looser target than the bound
        target_peak = _peak(scratch.table(), loads, ep) / tolerance
        if in_nodes and _peak(table, loads, ep) <= target_peak:
            return unchanged

    if not in_nodes:
        start = _matched_ranks(table.reshape(ep, -1), scratch.table().reshape(ep, -1), len(loads), num_nodes)
        start = start.ravel()
    elif num_nodes > 1 and _node_bound(table, loads, ep, num_groups, num_nodes) > target_peak:
        start = _regrouped(table, loads, ep, num_groups, num_nodes, target_peak)
    else:
        start = table
    states = _searched(start, loads, ep, num_nodes, target_peak, tolerance, scratch,
                       repack=num_nodes > 1 or compare_to_scratch)
    final_peak = states[-1][0]
    # The moves' best estimates what can be reached where the bound cannot.
    good_enough = target_peak if final_peak <= target_peak or compare_to_scratch else final_peak / tolerance
    # The first placement on the way that is good enough: the current one, if it may stay, or the
    # fewest moves.
    candidates = ([(_peak(table, loads, ep), table)] if in_nodes else []) + states
    for peak, candidate in candidates:
        if peak <= good_enough:
            return _update(current, candidate, load, before)
    matched = _matched_ranks(table.reshape(ep, -1), scratch.table().reshape(ep, -1), len(loads), num_nodes)
    return _update(current, matched.ravel(), load, before)


class _Scratch:
    """From-scratch placements (:meth:`ExpertPlacement.balanced`) of one call, each computed once: of
    the whole layer, and of single nodes (a node's experts on its slots and ranks)."""

    def __init__(self, loads: np.ndarray, num_slots: int, ep_size: int, num_groups: int, num_nodes: int):
        self.loads, self.num_slots, self.ep_size = loads, num_slots, ep_size
        self.hierarchy = {} if num_nodes == 1 else {"num_groups": num_groups, "num_nodes": num_nodes}
        self.cache: dict = {}

    def table(self) -> np.ndarray:
        """[S] the whole layer's slot -> expert table."""
        if "layer" not in self.cache:
            placement = ExpertPlacement.balanced(self.loads.tolist(), self.num_slots, self.ep_size, **self.hierarchy)
            self.cache["layer"] = np.asarray(placement.slot_to_expert.tolist(), dtype=np.int64)
        return self.cache["layer"]

    def node_ranks(self, experts: np.ndarray, num_slots: int, num_ranks: int) -> tuple[np.ndarray, float]:
        """([ranks, slots per rank] expert ids, heaviest rank's load) of ``experts`` packed alone."""
        key = (tuple(experts.tolist()), num_slots, num_ranks)
        if key not in self.cache:
            node_loads = self.loads[experts].tolist()
            placement = ExpertPlacement.balanced(node_loads, num_slots, num_ranks)
            ranks = experts[np.asarray(placement.slot_to_expert.tolist())].reshape(num_ranks, -1)
            self.cache[key] = (ranks, float(placement.rank_loads(node_loads).max()))
        return self.cache[key]


def _searched(table: np.ndarray, loads: np.ndarray, ep_size: int, num_nodes: int, target_peak: float,
              tolerance: float, scratch: _Scratch, repack: bool) -> list[tuple[float, np.ndarray]]:
    """(peak, table) at the start and after each step towards ``target_peak``, the last the best.

    Few-slot moves from ``table``; if they stall short of the target, the same after setting the replica
    counts to the from-scratch policy's, kept if that ends lighter by more than the tolerance. Where one
    replica alone is over the target, the counts are set first, and (flat) the matched from-scratch
    placement is tried as the start too. Where the moves still stall and ``repack``, the heaviest
    rank's node is re-packed from scratch if that lowers the peak (ranks matched to the old ones), and
    the moves go on; with one node that is the whole layer, which only ``compare_to_scratch`` pays for.
    A node is re-packed at most once."""
    slots_per_node, ranks_per_node = table.shape[0] // num_nodes, ep_size // num_nodes
    max_moves = 4 * table.shape[0]
    counts = np.bincount(table, minlength=loads.shape[0])
    states = [(_peak(table, loads, ep_size), table)]
    if float((loads / counts).max()) > target_peak:
        # One replica alone is over the target: the replica counts are far from what the load wants
        # (the hot experts changed). Setting them all first is cheaper than one slot at a time, which
        # would stall with the replicas where the old load wanted them.
        recounted = _recounted(table, loads, ep_size, num_nodes, target_peak, max_moves)
        states += recounted.states
        if states[-1][0] > target_peak and num_nodes == 1:
            # Still short: so far off, the from-scratch packing (ranks matched) may be the better start.
            search = ReplicaMoves(_matched_ranks(table.reshape(ep_size, -1), scratch.table().reshape(ep_size, -1),
                                                 loads.shape[0], 1).ravel(), loads, ep_size)
            search.lower_peak(target_peak, max_moves)
            if search.states[-1][0] < states[-1][0]:
                states = states[:1] + search.states
        # Then the moves from where that ended, as a second call would make them.
        search = ReplicaMoves(states[-1][1], loads, ep_size, num_nodes)
        search.lower_peak(target_peak, max_moves)
        states += search.states[1:]
    else:
        search = ReplicaMoves(table, loads, ep_size, num_nodes)
        search.lower_peak(target_peak, max_moves)
        states += search.states
        if states[-1][0] > target_peak:
            # Stalled: setting the counts first moves more slots at once, so only if it ends lighter.
            recounted = _recounted(table, loads, ep_size, num_nodes, target_peak, max_moves)
            if recounted.states[-1][0] < states[-1][0] * tolerance:
                states = states[:1] + recounted.states
    repacked = set()
    while True:
        table = states[-1][1]
        rank_loads = ReplicaMoves(table, loads, ep_size, num_nodes).rank_loads()
        heavy = int(np.argmax(rank_loads))
        peak = float(rank_loads[heavy])
        node = heavy // ranks_per_node
        if peak <= target_peak or not repack or node in repacked:
            return states
        repacked.add(node)
        node_slots = slice(node * slots_per_node, (node + 1) * slots_per_node)
        new_ranks, packed_peak = scratch.node_ranks(np.unique(table[node_slots]), slots_per_node, ranks_per_node)
        if packed_peak >= peak:
            return states
        table = table.copy()
        table[node_slots] = _matched_ranks(table[node_slots].reshape(ranks_per_node, -1), new_ranks,
                                           loads.shape[0], 1).ravel()
        search = ReplicaMoves(table, loads, ep_size, num_nodes)
        search.lower_peak(target_peak, max_moves)
        states += search.states


def _recounted(table, loads, ep_size, num_nodes, target_peak, max_moves) -> ReplicaMoves:
    """The counts the load wants, then swaps only (for those counts the packing is what is off), then
    all moves."""
    search = ReplicaMoves(table, loads, ep_size, num_nodes)
    search.adjust_counts(_wanted_counts(table, loads, ep_size, num_nodes))
    search.lower_peak(target_peak, max_moves, swaps_only=True)
    search.lower_peak(target_peak, max_moves)
    return search


def _wanted_counts(table: np.ndarray, loads: np.ndarray, ep_size: int, num_nodes: int) -> np.ndarray:
    """[E] the replica counts the from-scratch policy gives each expert for ``loads``, per node of
    ``table`` (:func:`~megamoe.moe.placement.placement_policy.replica_counts`)."""
    counts = np.zeros(loads.shape[0], dtype=np.int64)
    for part in np.split(table, num_nodes):
        experts = np.unique(part)
        counts[experts] = replica_counts(loads[experts].tolist(), part.shape[0], ep_size // num_nodes)
    return counts


def peak_bound(loads: np.ndarray, num_slots: int, ep_size: int, num_groups: int = 1, num_nodes: int = 1) -> float:
    """A lower bound on the heaviest rank's load under :meth:`ExpertPlacement.balanced` for ``loads``:
    the mean rank load, and the largest share of one replica when replica counts are chosen to make it
    smallest; with nodes, both per node, for the node assignment of groups that policy makes."""
    groups_of_node = nodes_of_groups(loads.tolist(), num_groups, num_nodes) if num_nodes > 1 else [[0]]
    return max(_groups_bound(loads, groups, num_groups, num_slots // num_nodes, ep_size // num_nodes)
               for groups in groups_of_node)


def _groups_bound(loads: np.ndarray, groups, num_groups: int, slots: int, ranks: int) -> float:
    """:func:`peak_bound` of one node holding ``groups`` (``slots`` slots on ``ranks`` ranks)."""
    per_group = loads.shape[0] // num_groups
    node_loads = [float(x) for g in sorted(groups) for x in loads[g * per_group:(g + 1) * per_group]]
    return max(sum(node_loads) / ranks, _smallest_largest_share(node_loads, slots))


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


def _update(current: ExpertPlacement, new_table: np.ndarray, load, before: float) -> PlacementUpdate:
    old_table = np.asarray(current.slot_to_expert.tolist(), dtype=np.int64)
    changed = tuple(np.flatnonzero(old_table != new_table).tolist())
    if not changed:
        return PlacementUpdate(current, (), before, before)
    placement = ExpertPlacement(new_table.tolist(), current.num_experts, current.ep_size)
    after = placement.balancedness(load)
    logger.debug("re-placement: %d of %d slots changed, balancedness %.4f -> %.4f", len(changed),
                 current.num_slots, before, after)
    return PlacementUpdate(placement, changed, before, after)


# ---------------------------------------------------------------------------- nodes and groups


def _groups_of_nodes(table: np.ndarray, num_experts: int, num_groups: int, num_nodes: int):
    """The set of groups each node's slots hold."""
    per_group = num_experts // num_groups
    return [set((part // per_group).tolist()) for part in np.split(table, num_nodes)]


def _groups_in_nodes(table: np.ndarray, num_experts: int, num_groups: int, num_nodes: int) -> bool:
    """Whether every group's slots lie in one node and every node holds the same number of groups."""
    if num_nodes == 1:
        return True
    groups = _groups_of_nodes(table, num_experts, num_groups, num_nodes)
    return (all(len(g) == num_groups // num_nodes for g in groups)
            and len(set().union(*groups)) == sum(len(g) for g in groups))


def _node_bound(table: np.ndarray, loads: np.ndarray, ep_size: int, num_groups: int, num_nodes: int) -> float:
    """:func:`peak_bound` for the node assignment of groups in ``table`` (whose groups lie in one node each)."""
    slots, ranks = table.shape[0] // num_nodes, ep_size // num_nodes
    return max(_groups_bound(loads, groups, num_groups, slots, ranks)
               for groups in _groups_of_nodes(table, loads.shape[0], num_groups, num_nodes))


def _regrouped(table: np.ndarray, loads: np.ndarray, ep_size: int, num_groups: int, num_nodes: int,
               target_peak: float) -> np.ndarray:
    """``table`` with whole groups swapped between nodes until the node bound meets ``target_peak``
    (or no swap lowers the heaviest node). In a node whose groups changed, the experts that stay keep
    their slots and the arriving ones fill the rest (:func:`~megamoe.moe.placement.replica_moves.filled_slots`);
    the other nodes keep every slot.

    Each swap trades one group of the node with the highest bound for one group of another node, the
    pair lowering the higher of the two nodes' bounds most (ties to lower ids).
    """
    num_experts, slots = loads.shape[0], table.shape[0]
    slots_per_node, ranks_per_node = slots // num_nodes, ep_size // num_nodes
    old = _groups_of_nodes(table, num_experts, num_groups, num_nodes)
    groups = [sorted(g) for g in old]

    def bound(node_groups):
        return _groups_bound(loads, node_groups, num_groups, slots_per_node, ranks_per_node)

    for _ in range(num_groups * num_groups):
        bounds = [bound(g) for g in groups]
        heavy = max(range(num_nodes), key=lambda n: (bounds[n], -n))
        if bounds[heavy] <= target_peak:
            break
        best = None
        for other in range(num_nodes):
            if other == heavy:
                continue
            for i, mine in enumerate(groups[heavy]):
                for j, theirs in enumerate(groups[other]):
                    a = groups[heavy][:i] + [theirs] + groups[heavy][i + 1:]
                    b = groups[other][:j] + [mine] + groups[other][j + 1:]
                    worse = max(bound(a), bound(b))
                    if worse < bounds[heavy] and (best is None or worse < best[0]):
                        best = (worse, other, a, b)
        if best is None:
            break
        _, other, groups[heavy], groups[other] = best
        groups[heavy].sort()
        groups[other].sort()

    per_group = num_experts // num_groups
    new_table = table.copy()
    for node, node_groups in enumerate(groups):
        if set(node_groups) == old[node]:
            continue
        # The staying experts keep their slots (up to the replicas the load wants); the rest of the node's
        # slots go to the arriving group's replicas and the staying experts short of replicas.
        experts = [e for g in node_groups for e in range(g * per_group, (g + 1) * per_group)]
        wanted = np.zeros(num_experts, dtype=np.int64)
        wanted[experts] = replica_counts(loads[experts].tolist(), slots_per_node, ranks_per_node)
        node_slots = slice(node * slots_per_node, (node + 1) * slots_per_node)
        kept = np.zeros(num_experts, dtype=np.int64)
        node_table = table[node_slots].copy()
        for slot, expert in enumerate(node_table.tolist()):
            if kept[expert] < wanted[expert]:
                kept[expert] += 1
            else:
                node_table[slot] = -1
        arriving = [e for e in experts for _ in range(wanted[e] - kept[e])]
        new_table[node_slots] = filled_slots(node_table, loads / np.maximum(wanted, 1), arriving,
                                             table.shape[0] // ep_size, ranks_per_node,
                                             np.zeros(num_experts, dtype=np.int64))
    return new_table


# ---------------------------------------------------------------------------- matching ranks


def matched_to(current: ExpertPlacement, new: ExpertPlacement, num_nodes: int = 1) -> np.ndarray:
    """``new``'s slot table with its ranks relabelled to keep as many experts as possible on their rank
    of ``current`` (a rank's experts move together; nodes, blocks of ``ep_size / num_nodes`` ranks, move
    together too), and within each rank every expert that stays in its old slot."""
    shape = (current.ep_size, current.slots_per_rank)
    old_ranks = np.asarray(current.slot_to_expert.tolist(), dtype=np.int64).reshape(shape)
    new_ranks = np.asarray(new.slot_to_expert.tolist(), dtype=np.int64).reshape(shape)
    return _matched_ranks(old_ranks, new_ranks, current.num_experts, num_nodes).ravel()


def _matched_ranks(old_ranks: np.ndarray, new_ranks: np.ndarray, num_experts: int, num_nodes: int) -> np.ndarray:
    """[ranks, slots per rank]: ``new_ranks``'s rows placed onto the rows of ``old_ranks``.

    Rank contents are multisets of experts; keeping them on a rank that held them saves a transfer, so
    the relabelling maximises the summed multiset overlap: a minimum-cost assignment of nodes to nodes,
    each pair scored by the best assignment of its ranks.
    """
    ep, spr = old_ranks.shape
    rank_ids = np.repeat(np.arange(ep), spr)
    old_counts = np.zeros((ep, num_experts), dtype=np.int64)
    new_counts = np.zeros((ep, num_experts), dtype=np.int64)
    np.add.at(old_counts, (rank_ids, old_ranks.ravel()), 1)
    np.add.at(new_counts, (rank_ids, new_ranks.ravel()), 1)
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
    node_match = min_cost_assignment(-node_score) if num_nodes > 1 else [0]

    result = old_ranks.copy()
    for new_node, old_node in enumerate(node_match):
        for i, j in enumerate(rank_matches[new_node, old_node]):
            new_rank, old_rank = new_node * rpn + i, old_node * rpn + j
            result[old_rank] = _kept_in_slot(old_ranks[old_rank].tolist(), new_ranks[new_rank].tolist())
    return result


def _kept_in_slot(old_slots: list[int], new_experts: list[int]) -> list[int]:
    """One rank's slots holding the multiset ``new_experts``: each expert already in a slot stays there
    (its first copies, in slot order), the rest fill the freed slots in ascending expert order."""
    remaining: dict[int, int] = {}
    for expert in new_experts:
        remaining[expert] = remaining.get(expert, 0) + 1
    slots: list[int | None] = [None] * len(old_slots)
    for slot, expert in enumerate(old_slots):
        if remaining.get(expert, 0) > 0:
            slots[slot] = expert
            remaining[expert] -= 1
    arriving = iter(sorted(expert for expert, count in remaining.items() for _ in range(count)))
    return [expert if expert is not None else next(arriving) for expert in slots]
