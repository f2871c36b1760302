"""Placement policies: which expert each slot holds, chosen from per-expert loads.

The balanced policy behind :meth:`megamoe.moe.placement.expert_slots.ExpertPlacement.balanced` (which validates its
arguments and keeps the default layout when that is better): replica counts, then packing replicas onto
EP ranks, optionally inside nodes holding whole expert groups (DeepSeek EPLB's hierarchical policy).
"""

from __future__ import annotations

import heapq

import numpy as np


def balanced_slot_to_expert(loads: list[float], num_slots: int, ep_size: int, num_groups: int,
                            num_nodes: int) -> list[int]:
    """The slot -> expert table of steps 1-2 of :meth:`~megamoe.moe.placement.expert_slots.ExpertPlacement.balanced`
    for ``loads`` (one per expert); the arguments are already validated there."""
    num_experts = len(loads)
    experts_per_group = num_experts // num_groups
    groups_of_node = nodes_of_groups(loads, num_groups, num_nodes)

    slots_per_rank = num_slots // ep_size
    slot_to_expert: list[int] = []
    for node_groups in groups_of_node:
        node_experts = sorted(
            expert for group in node_groups
            for expert in range(group * experts_per_group, (group + 1) * experts_per_group)
        )
        node_loads = [loads[e] for e in node_experts]
        counts = replica_counts(node_loads, num_slots // num_nodes, ep_size // num_nodes)
        ranks = _improved_by_moving_replicas(node_loads, counts, ep_size // num_nodes, slots_per_rank)
        slot_to_expert.extend(node_experts[e] for rank_experts in ranks for e in rank_experts)
    return slot_to_expert


def nodes_of_groups(loads: list[float], num_groups: int, num_nodes: int) -> list[list[int]]:
    """The groups each node takes in the hierarchical policy: whole groups of contiguous experts packed
    onto ``num_nodes`` nodes by their summed load (step 0 of :func:`balanced_slot_to_expert`)."""
    experts_per_group = len(loads) // num_groups
    group_loads = [sum(loads[g * experts_per_group:(g + 1) * experts_per_group]) for g in range(num_groups)]
    return _pack(group_loads, list(range(num_groups)), num_nodes, num_groups // num_nodes)


# Replica moves tried per round, and rounds at most: (donors x receivers) packings per round.
_MOVE_CANDIDATES, _MOVE_ROUNDS = 2, 4


def _packed_ranks(loads: list[float], counts: list[int], num_ranks: int, slots_per_rank: int
                  ) -> tuple[float, list[list[int]]]:
    """(heaviest rank load, each rank's experts sorted) of packing ``counts`` replicas of each expert."""
    replica_expert = [e for e, count in enumerate(counts) for _ in range(count)]
    replica_weight = [loads[e] / count for e, count in enumerate(counts) for _ in range(count)]
    bins = _pack(replica_weight, replica_expert, num_ranks, slots_per_rank)
    return _peak(bins, replica_weight), [sorted(replica_expert[i] for i in rank) for rank in bins]


def _improved_by_moving_replicas(loads: list[float], counts: list[int], num_ranks: int,
                                 slots_per_rank: int) -> list[list[int]]:
    """Each rank's experts after packing ``counts``, improved by moving single replicas between experts.

    The replica counts are chosen before the packing, for even shares per replica, but with few slots
    per rank the packing decides: loads [33, 68, 17], 8 slots on 4 ranks pack [2, 4, 2] replicas at
    balancedness 0.881 and [2, 5, 1] at 0.964 (an expert may then hold more replicas than there are
    ranks). Each round tries moving one replica from the experts losing least by it to the experts with
    the heaviest replicas, and keeps the move that lowers the heaviest rank most; it stops when none does.
    """
    peak, ranks = _packed_ranks(loads, counts, num_ranks, slots_per_rank)
    for _ in range(_MOVE_ROUNDS):
        receivers = sorted(range(len(counts)), key=lambda e: (-loads[e] / counts[e], e))[:_MOVE_CANDIDATES]
        donors = sorted((e for e in range(len(counts)) if counts[e] > 1),
                        key=lambda e: (loads[e] / (counts[e] - 1), e))[:_MOVE_CANDIDATES]
        best = None
        for donor in donors:
            for receiver in receivers:
                if donor == receiver:
                    continue
                trial = list(counts)
                trial[donor] -= 1
                trial[receiver] += 1
                trial_peak, trial_ranks = _packed_ranks(loads, trial, num_ranks, slots_per_rank)
                if trial_peak < peak * (1 - 1e-9) and (best is None or trial_peak < best[0]):
                    best = (trial_peak, trial_ranks, trial)
        if best is None:
            break
        peak, ranks, counts = best
    return ranks


def _peak(bins: list[list[int]], weights: list[float]) -> float:
    return max(sum(weights[i] for i in items) for items in bins)


def _same_label_pairs(bins_of_labels: list[list[int]]) -> int:
    return sum(len(labels) - len(set(labels)) for labels in bins_of_labels)


def replica_counts(loads: list[float], num_replicas: int, num_ranks: int) -> list[int]:
    """One replica per expert, then each extra one to the expert with the highest load per replica.

    An expert gets at most ``num_ranks`` replicas while any other expert can still take one: a replica
    beyond one per rank must share a rank with a sibling, which adds no parallelism, and an uneven count
    such as 3 replicas on 2 ranks leaves one rank with 2/3 of the expert's tokens. Past that, the cap
    grows by whole multiples of ``num_ranks``. Ties go to the expert with fewer replicas, then the lower
    index, so an all-zero load replicates round-robin instead of piling every replica onto expert 0.
    """
    counts = [1] * len(loads)
    cap = num_ranks
    heap = [(-load, 1, expert) for expert, load in enumerate(loads)]
    heapq.heapify(heap)
    full: list[tuple[float, int, int]] = []  # entries of experts at the cap, kept for when the cap grows
    for _ in range(num_replicas - len(loads)):
        while not heap or heap[0][1] >= cap:
            if heap:
                full.append(heapq.heappop(heap))
            else:
                cap += num_ranks
                heap, full = full, []
                heapq.heapify(heap)
        _, _, expert = heapq.heappop(heap)
        counts[expert] += 1
        heapq.heappush(heap, (-loads[expert] / counts[expert], counts[expert], expert))
    return counts


def _pack(weights: list[float], labels: list[int], num_bins: int, capacity: int) -> list[list[int]]:
    """Split items into ``num_bins`` bins of exactly ``capacity`` items, keeping the heaviest bin light.

    Greedy longest-processing-time first (heaviest item to the lightest bin with room), once preferring
    bins that do not already hold an item of the same label (two replicas of one expert on one rank give
    that rank no extra parallelism) and once not; each followed by swaps that lower the heaviest bin, then
    swaps that separate same-label items without raising the heaviest bin. The result with the lighter
    heaviest bin is kept (then fewer same-label pairs, then the label-aware one). Load comes first: a
    same-label pair is kept when separating it would cost balance. Returns the item indices of each bin.
    """
    results = []  # (peak, same-label pairs, bins) of the label-aware start, then of the plain one
    weight = np.asarray(weights, dtype=np.float64)
    label_of = np.asarray(labels, dtype=np.int64)
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], labels[i], i))
    # The label-aware greedy start can trap the swaps at a worse peak than plain LPT (a Zipf(1.5) load over
    # 64 experts, 72 slots, 8 ranks: balancedness 0.987 against 0.9999): search from both, keep the lighter.
    for label_aware in (True, False):
        bins = np.zeros((num_bins, capacity), dtype=np.int64)
        sizes = np.zeros(num_bins, dtype=np.int64)
        bin_loads = np.zeros(num_bins)
        bin_labels = np.zeros((num_bins, int(label_of.max()) + 1), dtype=np.int64)
        for item in order:
            label = labels[item]
            room = sizes < capacity
            pool = room & (bin_labels[:, label] == 0) if label_aware else room
            if not pool.any():
                pool = room
            target = int(np.argmin(np.where(pool, bin_loads, np.inf)))  # the lowest index on a tie
            bins[target, sizes[target]] = item
            sizes[target] += 1
            bin_loads[target] += weight[item]
            bin_labels[target, label] += 1
        packing = _Packing(bins, bin_loads, bin_labels, weight, label_of)
        packing.lower_peak()
        packing.separate_labels()
        bin_lists = bins.tolist()
        results.append((float(bin_loads.max()), _same_label_pairs([[labels[i] for i in b] for b in bin_lists]),
                        bin_lists))
    (aware_peak, aware_pairs, aware_bins), (plain_peak, plain_pairs, plain_bins) = results
    # A peak lower only by rounding is no gain: then the fewer same-label pairs win, and the label-aware
    # start on a tie.
    lower = plain_peak < aware_peak * (1 - 1e-9)
    same = not lower and plain_peak <= aware_peak * (1 + 1e-9)
    return plain_bins if lower or (same and plain_pairs < aware_pairs) else aware_bins


class _Packing:
    """Bins of items under local search by pairwise swaps (one item of one bin for one of another).

    ``bins`` [bins, capacity] item ids (a swap keeps positions), ``loads`` [bins], ``bin_labels`` [bins,
    labels] item counts per label; updated in place. Every candidate swap of a round is scored at once
    (numpy, elementwise: the same float64 operations in the same order as one swap at a time).
    """

    def __init__(self, bins, bin_loads, bin_labels, weights, labels):
        self.bins, self.loads, self.bin_labels = bins, bin_loads, bin_labels
        self.weights, self.labels = weights, labels
        self.max_swaps = 4 * len(weights)  # a bound on the worst case; both passes stop well before

    def lower_peak(self) -> None:
        """Swap an item of the heaviest bin for a lighter one elsewhere while that lowers the heaviest bin.

        Each swap leaves both bins strictly below the old peak, so (peak, number of bins at the peak)
        strictly decreases. A swap that puts two same-label items together is taken only when no other
        swap lowers the heaviest bin; among the rest, the lowest resulting peak wins (then the fewest
        added pairs, then the lowest other bin and positions).
        """
        num_bins, capacity = self.bins.shape
        for _ in range(self.max_swaps):
            heavy = int(np.argmax(self.loads))  # the lowest index on a tie
            peak = self.loads[heavy]
            delta = self.weights[self.bins[heavy]][:, None, None] - self.weights[self.bins][None, :, :]
            new_peak = np.maximum(peak - delta, self.loads[None, :, None] + delta)  # [pos in heavy, other, pos]
            valid = (delta > 0) & (new_peak < peak)
            valid[:, heavy, :] = False
            if not valid.any():
                return
            added = self._added_pairs(heavy)
            pos_heavy, other, pos_other = np.nonzero(valid)
            chosen = np.lexsort((pos_other, pos_heavy, other, added[valid], new_peak[valid], added[valid] > 0))[0]
            self._swap(heavy, int(pos_heavy[chosen]), int(other[chosen]), int(pos_other[chosen]))

    def separate_labels(self) -> None:
        """Swaps that remove same-label pairs while keeping both bins at or below the current peak."""
        for _ in range(self.max_swaps):
            peak = self.loads.max()
            crowded, pos = np.nonzero(np.take_along_axis(self.bin_labels, self.labels[self.bins], axis=1) >= 2)
            if crowded.size == 0:
                return
            best = None  # (added same-label pairs (< 0), new peak of the two bins, bin, pos, other bin, pos)
            for c, p in zip(crowded.tolist(), pos.tolist()):  # few: only items sharing a bin with a sibling
                delta = self.weights[self.bins[c, p]] - self.weights[self.bins]  # [other, pos]
                new_peak = np.maximum(self.loads[c] - delta, self.loads[:, None] + delta)
                added = self._added_pairs(c, p)[0]
                valid = (added < 0) & (new_peak <= peak)
                valid[c, :] = False
                if not valid.any():
                    continue
                other, pos_other = np.nonzero(valid)
                k = np.lexsort((pos_other, other, new_peak[valid], added[valid]))[0]
                candidate = (int(added[other[k], pos_other[k]]), float(new_peak[other[k], pos_other[k]]), c, p,
                             int(other[k]), int(pos_other[k]))
                best = candidate if best is None or candidate < best else best
            if best is None:
                return
            self._swap(best[2], best[3], best[4], best[5])

    def _added_pairs(self, bin_a: int, pos: int | None = None) -> np.ndarray:
        """[positions of bin_a (or just ``pos``), other bin, position]: the change in the number of
        same-label pairs if that item of ``bin_a`` and the other bin's item swap (0 for equal labels).
        Pairs are counted as (count - 1) per label present in a bin."""
        counts = self.bin_labels
        label_a = self.labels[self.bins[bin_a] if pos is None else self.bins[bin_a, pos:pos + 1]]  # [k]
        label_b = self.labels[self.bins]  # [other, pos]
        rows = np.arange(counts.shape[0])[:, None]
        change = (-(counts[bin_a, label_a] >= 2).astype(np.int64)[:, None, None]  # label_a leaves bin_a
                  + (counts[bin_a, label_b] >= 1)[None]  # label_b joins bin_a
                  - (counts[rows, label_b] >= 2)[None]  # label_b leaves the other bin
                  + (counts[:, label_a] >= 1).T[:, :, None])  # label_a joins it
        return np.where(label_a[:, None, None] == label_b[None], 0, change)

    def _swap(self, bin_a: int, pos_a: int, bin_b: int, pos_b: int) -> None:
        item_a, item_b = int(self.bins[bin_a, pos_a]), int(self.bins[bin_b, pos_b])
        self.bins[bin_a, pos_a], self.bins[bin_b, pos_b] = item_b, item_a
        delta = self.weights[item_a] - self.weights[item_b]
        self.loads[bin_a] -= delta
        self.loads[bin_b] += delta
        self.bin_labels[bin_a, self.labels[item_a]] -= 1
        self.bin_labels[bin_a, self.labels[item_b]] += 1
        self.bin_labels[bin_b, self.labels[item_b]] -= 1
        self.bin_labels[bin_b, self.labels[item_a]] += 1
