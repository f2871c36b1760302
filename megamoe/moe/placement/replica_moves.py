"""Local search over a slot -> expert table: few-slot moves that lower the heaviest EP rank.

The movement-aware half of :func:`megamoe.moe.placement.replacement.replace_experts`. Two kinds of move, each
changing the expert of one or two slots and nothing else, so every other expert stays in its slot:

- *reassign* one slot from an expert with several replicas (the donor) to another expert (the
  receiver): the replica counts change, so every replica of both experts changes weight (1 slot moved);
- *swap* the experts of two slots on different ranks: counts stay, two ranks trade load (2 slots moved).

Each round takes, among the moves that take the heaviest rank below the peak and no rank up to it, the
one that lowers the ranks' summed excess over a target most per slot moved (or, when none does, the
peak itself); it stops at the target or when no move is left (see :meth:`ReplicaMoves.lower_peak`).
A move that puts a second replica of an expert on a rank (which adds no parallelism there) is only
taken when no other move helps. All arithmetic is elementwise numpy on
float64 (no BLAS), so every rank computes bit-identical loads; ties go to lower slot and expert ids.
With nodes (the hierarchical policy) moves stay inside the heaviest rank's node.
"""

from __future__ import annotations

import numpy as np

# The least a move by the peak must lower the heaviest rank, as a fraction of the peak: without it a
# search short of an unreachable target ends in hundreds of moves gaining 1e-5 each.
_MIN_GAIN = 1e-3
# Reassign = 0, swap = 1: the move kinds, in the order a tie prefers them.
_REASSIGN, _SWAP = 0, 1
# A donor slot on the heaviest rank is offered to this many lightest-replica experts, and to the experts
# on this many heaviest ranks.
_LIGHT_RECEIVERS, _HEAVY_RANKS = 16, 8


class ReplicaMoves:
    """One layer's slot table under the search; ``table`` is updated in place."""

    def __init__(self, table: np.ndarray, load: np.ndarray, ep_size: int, num_nodes: int = 1):
        self.table = table.astype(np.int64)  # [S] expert of each slot
        self.load = load.astype(np.float64)  # [E]
        self.num_experts = load.shape[0]
        self.ep_size = ep_size
        self.slots_per_rank = table.shape[0] // ep_size
        self.ranks_per_node = ep_size // num_nodes
        self.owner = np.arange(table.shape[0]) // self.slots_per_rank  # [S] rank of each slot
        # presence[r, e]: replicas of expert e on rank r
        self.presence = np.zeros((ep_size, self.num_experts), dtype=np.int64)
        np.add.at(self.presence, (self.owner, self.table), 1)
        self.counts = self.presence.sum(axis=0)  # [E]
        self.by_expert = np.ascontiguousarray(self.presence.T)  # [E, ep] the same counts, rows per expert
        # The experts a node may hold: those it holds now (the caller checked groups lie in one node).
        node_of_slot = self.owner // self.ranks_per_node
        self.node_of_expert = np.zeros(self.num_experts, dtype=np.int64)
        self.node_of_expert[self.table] = node_of_slot
        self.states: list[tuple[float, np.ndarray]] = []  # (peak, table) at the start and after each move

    def rank_loads(self) -> np.ndarray:
        weight = self.load / self.counts  # [E] tokens per replica
        return weight[self.table].reshape(self.ep_size, self.slots_per_rank).sum(axis=1)

    def lower_peak(self, target_peak: float, max_moves: int, swaps_only: bool = False) -> None:
        """Moves until the heaviest rank is at or below ``target_peak``, no move helps, or ``max_moves``.

        Every move takes the heaviest rank below the peak and no other rank up to it, so (peak, ranks at
        the peak) strictly decreases: the search cannot cycle, and where it stops no move is left (a
        second call from its result moves nothing). Among those moves it takes the one lowering the
        summed excess of the ranks over the target most per slot moved (many ranks are usually over it,
        and a move that only shifts the excess from the heaviest rank to the next gains nothing); when
        none lowers it, the one lowering the peak most (the target comes from a bound and may be out of
        reach), then back to the excess. ``swaps_only``: keep the replica counts.
        """
        by_excess = True
        loads = self._recorded(self.rank_loads())
        for _ in range(max_moves):
            heavy = int(np.argmax(loads))
            peak = float(loads[heavy])
            if peak <= target_peak:
                return
            # By excess any gain counts (the excess ends at the target); by the peak, at least _MIN_GAIN.
            min_gain = 1e-12 * peak if by_excess else _MIN_GAIN * peak
            goal = _Goal(loads, heavy, peak, target_peak if by_excess else None, min_gain)
            candidates = [self._best_swap(goal)] + ([] if swaps_only else [self._best_reassign(goal)])
            best = min((c for c in candidates if c), default=None)
            if best is None:
                if not by_excess:
                    return
                by_excess = False
                continue
            self._apply(best)
            by_excess = True
            loads = self._recorded(self.rank_loads())

    def adjust_counts(self, target_counts: np.ndarray) -> None:
        """Give each expert ``target_counts`` replicas by reassigning only the surplus slots: an expert
        with too many gives up those on the heaviest ranks; the freed slots go, heaviest new replica
        first, to the lightest rank with a freed slot (one not holding the expert if possible). A big
        change of load (the hot experts are others now) needs this: one slot at a time, the moves
        would stall with the replicas where the old load wanted them. Counts must sum per node as now."""
        weight = self.load / self.counts
        loads = weight[self.table].reshape(self.ep_size, self.slots_per_rank).sum(axis=1)
        surplus = self.counts - target_counts
        freed = []
        for expert in np.flatnonzero(surplus > 0).tolist():
            slots = np.flatnonzero(self.table == expert)
            order = np.lexsort((slots, -loads[self.owner[slots]]))
            freed += slots[order[:surplus[expert]]].tolist()
        if not freed:
            return
        for slot in freed:
            self._reassign(slot, -1)
        arriving = [e for e in np.flatnonzero(surplus < 0).tolist() for _ in range(-surplus[e])]
        filled = filled_slots(self.table, self.load / np.maximum(target_counts, 1), arriving, self.slots_per_rank,
                              self.ranks_per_node, self.node_of_expert)
        for slot in freed:
            self._reassign(slot, int(filled[slot]))
        self._recorded(self.rank_loads())

    def _reassign(self, slot: int, expert: int) -> None:
        """Slot ``slot`` to ``expert`` (-1: empty, only inside :meth:`adjust_counts`)."""
        old = int(self.table[slot])
        rank = int(self.owner[slot])
        if old >= 0:
            self.presence[rank, old] -= 1
            self.by_expert[old, rank] -= 1
            self.counts[old] -= 1
        if expert >= 0:
            self.presence[rank, expert] += 1
            self.by_expert[expert, rank] += 1
            self.counts[expert] += 1
        self.table[slot] = expert

    def _recorded(self, loads: np.ndarray) -> np.ndarray:
        self.states.append((float(loads.max()), self.table.copy()))
        return loads

    # ------------------------------------------------------------------ candidates

    def _node_slots(self, heavy: int) -> np.ndarray:
        node = heavy // self.ranks_per_node
        first = node * self.ranks_per_node * self.slots_per_rank
        return np.arange(first, first + self.ranks_per_node * self.slots_per_rank)

    def _best_swap(self, goal: "_Goal"):
        """The best swap of a slot on the heaviest rank with a slot on another rank of its node, or None."""
        spr, heavy, loads = self.slots_per_rank, goal.heavy, goal.loads
        weight = self.load / self.counts
        mine = np.arange(heavy * spr, (heavy + 1) * spr)
        others = self._node_slots(heavy)
        others = others[self.owner[others] != heavy]
        if others.size == 0:
            return None
        delta = weight[self.table[mine]][:, None] - weight[self.table[others]][None, :]  # [spr, n]
        other_rank = self.owner[others]
        new_heavy = goal.peak - delta
        new_other = loads[other_rank][None, :] + delta
        # Both ranks end below the peak; by excess, the summed excess over the target must drop too.
        valid = (delta >= goal.min_gain) & (new_other < goal.peak)
        if goal.target is None:
            rest = self._max_excluding(loads, heavy)[other_rank]  # [n] peak of the untouched ranks
            gain = goal.peak - np.maximum(np.maximum(new_heavy, new_other), rest[None, :])
        else:
            gain = (goal.excess(goal.peak) + goal.excess(loads[other_rank])[None, :]
                    - goal.excess(new_heavy) - goal.excess(new_other))
            valid &= gain >= goal.min_gain
        if not valid.any():
            return None
        a = self.table[mine][:, None]
        b = self.table[others][None, :]
        p = self.presence
        added = ((p[other_rank[None, :], a] >= 1).astype(np.int64) + (p[heavy, b] >= 1)
                 - (p[heavy, a] >= 2) - (p[other_rank[None, :], b] >= 2))
        adds_pair = (added > 0) & (a != b)
        local_peak = np.maximum(new_heavy, new_other)
        i, j = self._argbest(valid, adds_pair, gain / 2, local_peak)
        return (bool(adds_pair[i, j]), -float(gain[i, j]) / 2, float(local_peak[i, j]),
                _SWAP, int(mine[i]), int(others[j]))

    def _best_reassign(self, goal: "_Goal"):
        """The best reassignment of one slot that lowers the heaviest rank, or None.

        Receivers are the experts on the heaviest rank (their replicas there get lighter), with donor
        slots anywhere in the node; or, with donor slots on the heaviest rank, the experts of the node
        that can help most.
        """
        spr, heavy, loads, peak = self.slots_per_rank, goal.heavy, goal.loads, goal.peak
        weight = self.load / self.counts
        node_slots = self._node_slots(heavy)
        mine = np.arange(heavy * spr, (heavy + 1) * spr)
        node = heavy // self.ranks_per_node
        replicated = node_slots[self.counts[self.table[node_slots]] >= 2]
        mine_replicated = mine[self.counts[self.table[mine]] >= 2]
        receivers = np.unique(self.table[mine])
        # Receivers for the donor slots on the heaviest rank: the experts whose new replica would be
        # lightest (the heaviest rank drops most), and those on the heaviest ranks of the node (their
        # replicas there get lighter too); any other expert only helps less.
        node_experts = np.flatnonzero(self.node_of_expert == node)
        lightest = node_experts[np.argsort(self.load[node_experts] / (self.counts[node_experts] + 1),
                                           kind="stable")[:_LIGHT_RECEIVERS]]
        node_ranks = np.arange(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)
        heavy_ranks = node_ranks[np.argsort(-loads[node_ranks], kind="stable")[:_HEAVY_RANKS]]
        on_heavy_ranks = self.table[(heavy_ranks[:, None] * spr + np.arange(spr)[None, :]).ravel()]
        other_receivers = np.union1d(lightest, on_heavy_ranks)
        # All (receiver, donor slot) combinations of both kinds, flattened.
        a = np.concatenate([np.repeat(receivers, replicated.size), np.repeat(other_receivers, mine_replicated.size)])
        slot = np.concatenate([np.tile(replicated, receivers.size), np.tile(mine_replicated, other_receivers.size)])
        d = self.table[slot]
        keep = a != d
        a, slot, d = a[keep], slot[keep], d[keep]
        if a.size == 0:
            return None
        rank = self.owner[slot]
        new_a = self.load[a] / (self.counts[a] + 1)
        new_d = self.load[d] / (self.counts[d] - 1)
        # Cheap filters first, on the two ranks every candidate must not raise: the heaviest rank and
        # the donor slot's rank.
        p = self.presence
        for on_heavy in (True, False):
            r = np.full(a.size, heavy) if on_heavy else rank
            new_r = (loads[r] + p[r, a] * (new_a - weight[a]) + p[r, d] * (new_d - weight[d])
                     + np.where(r == rank, new_a - new_d, 0.0))
            fine = (new_r <= peak - goal.min_gain) if on_heavy else (new_r < peak) | (new_r <= loads[r])
            a, slot, d, rank, new_a, new_d = a[fine], slot[fine], d[fine], rank[fine], new_a[fine], new_d[fine]
        if a.size == 0:
            return None
        new = (loads[None, :] + self.by_expert[a] * (new_a - weight[a])[:, None]
               + self.by_expert[d] * (new_d - weight[d])[:, None])  # [n, ep]
        new[np.arange(a.size), rank] += new_a - new_d
        # The heaviest rank drops below the peak and no rank rises to it; by excess, the summed excess
        # over the target must drop too.
        valid = (new[:, heavy] <= peak - goal.min_gain) & ((new < peak) | (new <= loads[None, :])).all(axis=1)
        if goal.target is None:
            gain = peak - new.max(axis=1)
        else:
            gain = goal.excess(loads).sum() - goal.excess(new).sum(axis=1)
            valid &= gain >= goal.min_gain
        if not valid.any():
            return None
        local_peak = np.where(new != loads[None, :], new, -np.inf).max(axis=1)  # of the changed ranks
        adds_pair = (self.presence[rank, a] >= 1) & ~(self.presence[rank, d] >= 2)
        (k,) = self._argbest(valid, adds_pair, gain, local_peak, order_key=slot * self.num_experts + a)
        return (bool(adds_pair[k]), -float(gain[k]), float(local_peak[k]), _REASSIGN, int(slot[k]), int(a[k]))

    @staticmethod
    def _argbest(valid, adds_pair, gain, local_peak, order_key=None):
        """Index of the valid candidate with the best (no added pair, gain per slot moved, lowest load
        of the ranks it changes); ties to the lowest ``order_key`` (default: the first in C order)."""
        index = np.flatnonzero(valid.ravel())
        key = index if order_key is None else order_key.ravel()[index]
        best = np.lexsort((key, local_peak.ravel()[index], -gain.ravel()[index], adds_pair.ravel()[index]))[0]
        return np.unravel_index(index[best], valid.shape)

    @staticmethod
    def _max_excluding(loads: np.ndarray, heavy: int) -> np.ndarray:
        """[ep] for each rank o: the highest load among ranks other than ``heavy`` and o."""
        masked = loads.copy()
        masked[heavy] = -np.inf
        first = int(np.argmax(masked))
        top = masked[first]
        masked[first] = -np.inf
        second = masked.max() if masked.size > 2 else -np.inf
        rest = np.full(loads.shape, top)
        rest[first] = second
        return rest

    def _apply(self, move) -> None:
        kind, slot, other = move[3], move[4], move[5]
        if kind == _SWAP:
            expert, other_expert = int(self.table[slot]), int(self.table[other])
            self._reassign(slot, other_expert)
            self._reassign(other, expert)
        else:
            self._reassign(slot, other)


def filled_slots(table: np.ndarray, weight: np.ndarray, arriving: list[int], slots_per_rank: int,
                 ranks_per_node: int, node_of_expert: np.ndarray) -> np.ndarray:
    """``table`` (-1: a free slot) with the ``arriving`` replicas placed, heaviest (by ``weight``, the
    load per replica each expert will have) first, each in a free slot of its node's lightest rank, a
    rank not holding the expert if there is one; ties to lower slots."""
    table = table.copy()
    owner = np.arange(table.shape[0]) // slots_per_rank
    kept = np.where(table >= 0, weight[np.maximum(table, 0)], 0.0)
    rank_loads = kept.reshape(-1, slots_per_rank).sum(axis=1).tolist()
    free = np.flatnonzero(table < 0).tolist()
    for expert in sorted(arriving, key=lambda e: (-weight[e], e)):
        node = node_of_expert[expert]
        choices = [s for s in free if owner[s] // ranks_per_node == node]
        slot = min(choices, key=lambda s: (bool((table[owner[s] * slots_per_rank:(owner[s] + 1) * slots_per_rank]
                                                  == expert).any()), rank_loads[owner[s]], s))
        free.remove(slot)
        table[slot] = expert
        rank_loads[owner[slot]] += weight[expert]
    return table


class _Goal:
    """What one round of moves aims at: the rank loads, the heaviest rank and its load, either a target
    peak (lower the summed excess over it) or None (lower the peak), and the least gain a move must make
    (on the heaviest rank, and in the excess)."""

    def __init__(self, loads, heavy, peak, target, min_gain):
        self.loads, self.heavy, self.peak, self.target, self.min_gain = loads, heavy, peak, target, min_gain

    def excess(self, loads):
        return np.maximum(loads - self.target, 0.0)
