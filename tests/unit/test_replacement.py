"""Movement-aware re-placement (replace_experts): few slots moved, balance close to from scratch, exact
changed slots, node constraints kept, deterministic; and the rank matching behind it."""

import itertools
import random

import numpy as np
import pytest
import torch

from megamoe.moe import PlacementUpdate, replace_experts
from megamoe.moe.placement.assignment import min_cost_assignment
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.moe.placement.replacement import matched_to, peak_bound


def zipf_load(num_experts: int, exponent: float, seed: int) -> torch.Tensor:
    """Zipf weights over a seeded random order of the experts."""
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))
    return 1e6 / (order.double() + 1) ** exponent


def noisy(load: torch.Tensor, seed: int, scale: float = 0.05) -> torch.Tensor:
    noise = torch.randn(load.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (load * (1 + scale * noise)).clamp(min=0)


def settled(load, num_slots, ep_size, **hierarchy) -> ExpertPlacement:
    """The placement the rebalancer would hold for ``load``: replace_experts from the balanced one."""
    start = ExpertPlacement.balanced(load, num_slots, ep_size, **hierarchy)
    return replace_experts(start, load, **hierarchy).placement


def groups_in_nodes(placement: ExpertPlacement, num_groups: int, num_nodes: int) -> bool:
    per_group = placement.num_experts // num_groups
    nodes = placement.slot_to_expert.view(num_nodes, -1) // per_group
    groups = [set(row.tolist()) for row in nodes]
    return all(len(g) == num_groups // num_nodes for g in groups) and len(set().union(*groups)) == num_groups


def test_an_unchanged_or_rescaled_load_changes_nothing():
    for num_experts, num_slots, ep_size, hierarchy in [(64, 72, 8, {}), (256, 288, 32, {}),
                                                       (256, 288, 32, {"num_groups": 8, "num_nodes": 4})]:
        for exponent, seed in [(1.0, 0), (1.5, 1)]:
            load = zipf_load(num_experts, exponent, seed)
            current = settled(load, num_slots, ep_size, **hierarchy)
            for same in (load, load * 3.5, load.float().tolist()):
                update = replace_experts(current, same, **hierarchy)
                assert update.changed_slots == () and not update.changed
                assert update.placement is current
                assert update.balancedness_before == update.balancedness_after == current.balancedness(same)
    # A balanced placement that already reaches the bound stays as it is too.
    load = zipf_load(64, 1.2, 3)
    balanced = ExpertPlacement.balanced(load, 72, 8)
    assert replace_experts(balanced, load).placement is balanced


@pytest.mark.parametrize("num_experts, num_slots, ep_size", [(64, 72, 8), (256, 288, 32)])
def test_five_percent_noise_moves_few_slots_and_stays_close_to_from_scratch(num_experts, num_slots, ep_size):
    cases = [(1.0, 0), (1.2, 1), (1.5, 2)] if num_experts == 64 else [(1.0, 0), (1.2, 1)]
    for exponent, seed in cases:
        load = zipf_load(num_experts, exponent, seed)
        current = settled(load, num_slots, ep_size)
        new_load = noisy(load, seed + 100)
        update = replace_experts(current, new_load)
        scratch = ExpertPlacement.balanced(new_load, num_slots, ep_size).balancedness(new_load)
        assert update.balancedness_before == current.balancedness(new_load)
        assert update.balancedness_after == update.placement.balancedness(new_load)
        assert update.balancedness_after >= 0.99 * scratch, (exponent, seed)
        assert len(update.changed_slots) <= 0.15 * num_slots, (exponent, seed, len(update.changed_slots))
        assert update.changed  # 5% noise does take the layer below the target here
        # A second call with the same load is a fixed point.
        assert replace_experts(update.placement, new_load).placement is update.placement


def test_changed_slots_are_exactly_the_slots_whose_expert_differs():
    load = zipf_load(64, 1.2, 0)
    current = ExpertPlacement.default(64, 80, 16)
    for step, new_load in enumerate([load, noisy(load, 1, 0.2), zipf_load(64, 1.4, 7), torch.zeros(64)]):
        update = replace_experts(current, new_load)
        assert isinstance(update, PlacementUpdate)
        differs = (update.placement.slot_to_expert != current.slot_to_expert).nonzero().flatten().tolist()
        assert list(update.changed_slots) == differs == sorted(differs), step
        assert bool((update.placement.replica_counts >= 1).all())  # every expert keeps a slot
        assert update.placement.num_slots == current.num_slots and update.placement.ep_size == current.ep_size
        current = update.placement
    # An all-zero load is perfectly balanced by any placement: nothing moved in the last step.
    assert update.changed_slots == ()


def test_a_far_off_placement_is_rebalanced_close_to_from_scratch():
    """From the default layout under a skewed load, the replica counts must change a lot first."""
    for seed in range(3):
        load = zipf_load(256, 1.2, seed)
        update = replace_experts(ExpertPlacement.default(256, 288, 32), load)
        scratch = ExpertPlacement.balanced(load, 288, 32).balancedness(load)
        assert update.balancedness_before < 0.5 and update.balancedness_after >= 0.99 * scratch


def test_relabelled_ranks_need_no_moves():
    """The rank matching: a placement whose ranks (and slots within a rank) were permuted is matched
    back onto the current ranks with zero changed slots."""
    rng = random.Random(0)
    current = ExpertPlacement.balanced(zipf_load(256, 1.2, 0), 288, 32)
    rows = current.slot_to_expert.view(32, 9).tolist()
    rng.shuffle(rows)
    for row in rows:
        rng.shuffle(row)
    relabelled = ExpertPlacement([e for row in rows for e in row], 256, 32)
    assert relabelled != current
    assert matched_to(current, relabelled).tolist() == current.slot_to_expert.tolist()
    # Hierarchical: nodes are relabelled as whole blocks of ranks.
    hierarchy = {"num_groups": 8, "num_nodes": 4}
    current = ExpertPlacement.balanced(zipf_load(256, 1.2, 1), 288, 32, **hierarchy)
    blocks = current.slot_to_expert.view(4, 8, 9)[[2, 0, 3, 1]]
    relabelled = ExpertPlacement(blocks[:, [7, 6, 5, 4, 3, 2, 1, 0]].flatten(), 256, 32)
    assert matched_to(current, relabelled, num_nodes=4).tolist() == current.slot_to_expert.tolist()


def test_matching_keeps_the_experts_that_stay_in_their_slots():
    current = ExpertPlacement([0, 1, 2, 3, 4, 5, 0, 1], num_experts=6, ep_size=2)
    # New rank contents {1, 2, 4, 5} (3 in common with old rank 1) and {0, 1, 3, 3} (3 with old rank 0).
    new = ExpertPlacement([1, 4, 5, 2, 0, 1, 3, 3], num_experts=6, ep_size=2)
    # Experts staying on a rank keep their slots; the newcomers take the freed ones.
    assert matched_to(current, new).tolist() == [0, 1, 3, 3, 4, 5, 2, 1]


def test_min_cost_assignment_is_optimal_and_breaks_ties_to_lower_columns():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 6)
        cost = [[rng.randint(0, 4) for _ in range(n)] for _ in range(n)]
        assignment = min_cost_assignment(cost)
        assert sorted(assignment) == list(range(n))
        best = min(sum(cost[i][p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
        assert sum(cost[i][assignment[i]] for i in range(n)) == best
    assert min_cost_assignment(np.zeros((3, 3))) == [0, 1, 2]
    with pytest.raises(ValueError, match="square"):
        min_cost_assignment([[1, 2]])


def test_hierarchical_keeps_every_group_inside_one_node():
    hierarchy = {"num_groups": 8, "num_nodes": 4}
    for seed in range(3):
        load = zipf_load(64, 1.2, seed)
        current = settled(load, 80, 16, **hierarchy)
        for new_load in (noisy(load, seed), zipf_load(64, 1.2, seed + 50)):  # noise, then other hot experts
            update = replace_experts(current, new_load, **hierarchy)
            assert groups_in_nodes(update.placement, 8, 4)
            scratch = ExpertPlacement.balanced(new_load, 80, 16, **hierarchy).balancedness(new_load)
            assert update.balancedness_after >= 0.99 * scratch
            assert replace_experts(update.placement, new_load, **hierarchy).placement is update.placement
            current = update.placement
    # A placement that ignores the nodes is re-packed into them.
    flat = ExpertPlacement.balanced(load, 80, 16)
    assert not groups_in_nodes(flat, 8, 4)
    assert groups_in_nodes(replace_experts(flat, load, **hierarchy).placement, 8, 4)


def test_hierarchical_moves_whole_groups_only_between_the_nodes_that_need_it():
    hierarchy = {"num_groups": 8, "num_nodes": 4}  # 8 groups of 8 experts, 20 slots per node

    def groups_of_nodes(placement):
        return [sorted(set((placement.slot_to_expert.view(4, -1)[n] // 8).tolist())) for n in range(4)]

    load = torch.ones(64)
    current = ExpertPlacement.balanced(load, 80, 16, **hierarchy)
    before = groups_of_nodes(current)
    # Both groups of node 0 get hot: no move inside a node helps; one of them must change nodes.
    hot = load.clone()
    for group in before[0]:
        hot[group * 8:(group + 1) * 8] = 4.0
    update = replace_experts(current, hot, **hierarchy)
    after = groups_of_nodes(update.placement)
    assert sum(bool(set(before[0]) & set(g)) for g in after) == 2  # the hot groups are on two nodes now
    untouched = [n for n in range(4) if after[n] == before[n]]
    assert len(untouched) == 2  # one swap of groups, between two nodes
    assert not any(slot // 20 in untouched for slot in update.changed_slots)  # the others keep every slot
    scratch = ExpertPlacement.balanced(hot, 80, 16, **hierarchy).balancedness(hot)
    assert update.balancedness_after >= 0.99 * scratch


def test_compare_to_scratch_guarantees_the_tolerance_against_from_scratch():
    for seed in range(4):
        load = zipf_load(32, 2.0, seed) * (1 + torch.rand(32, generator=torch.Generator().manual_seed(seed)))
        scratch = ExpertPlacement.balanced(load, 40, 8)
        update = replace_experts(ExpertPlacement.default(32, 40, 8), load, compare_to_scratch=True)
        assert update.balancedness_after >= 0.99 * scratch.balancedness(load)
        # The from-scratch placement itself is within the tolerance of itself: it stays.
        assert replace_experts(scratch, load, compare_to_scratch=True).placement is scratch


def test_the_same_inputs_give_the_same_update():
    load = noisy(zipf_load(256, 1.2, 4), 9)
    current = settled(zipf_load(256, 1.2, 4), 288, 32)
    first = replace_experts(current, load)
    again = replace_experts(ExpertPlacement.from_dict(current.to_dict()), load.clone())
    assert first.changed and first.placement == again.placement and first.changed_slots == again.changed_slots
    assert first.balancedness_after == again.balancedness_after


def test_peak_bound_is_below_every_placement():
    for seed in range(5):
        load = zipf_load(64, 1.5, seed)
        bound = peak_bound(load.numpy(), 72, 8)
        for placement in (ExpertPlacement.default(64, 72, 8), ExpertPlacement.balanced(load, 72, 8),
                          replace_experts(ExpertPlacement.default(64, 72, 8), load).placement):
            assert bound <= float(placement.rank_loads(load).max()) * (1 + 1e-12)


@pytest.mark.parametrize("call, message", [
    (lambda p: replace_experts(p.to_dict(), [1.0] * 8), "current must be an ExpertPlacement"),
    (lambda p: replace_experts(p, [1.0] * 7), "expert_load has 7 entries but there are 8 experts"),
    (lambda p: replace_experts(p, [1.0] * 7 + [-1.0]), r"expert_load\[7\] is negative"),
    (lambda p: replace_experts(p, [1.0] * 7 + [float("nan")]), "NaN"),
    (lambda p: replace_experts(p, [1.0] * 8, num_groups=4), "num_groups and num_nodes go together"),
    (lambda p: replace_experts(p, [1.0] * 8, num_groups=3, num_nodes=1), "not a multiple of num_groups"),
    (lambda p: replace_experts(p, [1.0] * 8, num_groups=4, num_nodes=3), "not a multiple of num_nodes"),
    (lambda p: replace_experts(p, [1.0] * 8, tolerance=0), r"tolerance must be a number in \(0, 1\]"),
    (lambda p: replace_experts(p, [1.0] * 8, tolerance=1.5), "tolerance"),
    (lambda p: replace_experts(p, [1.0] * 8, tolerance=True), "tolerance"),
    (lambda p: replace_experts(p, [1.0] * 8, compare_to_scratch=1), "compare_to_scratch must be True or False"),
])
def test_argument_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(ExpertPlacement.default(8, 12, 4))


def test_random_small_layouts_keep_the_invariants():
    """Random layouts, loads (ties and zeros included) and starting tables: the changed slots are exact,
    groups stay in their nodes, and compare_to_scratch reaches 0.99x the from-scratch balancedness."""
    rng = random.Random(0)
    for _ in range(60):
        hierarchy = {}
        if rng.random() < 0.3:
            num_nodes, ranks_per_node = rng.choice([2, 4]), rng.choice([1, 2])
            num_groups = num_nodes * rng.choice([1, 2])
            num_experts, ep_size = num_groups * rng.choice([2, 4]), num_nodes * ranks_per_node
            hierarchy = {"num_groups": num_groups, "num_nodes": num_nodes}
        else:
            num_experts, ep_size = rng.choice([3, 5, 8, 16]), rng.choice([1, 2, 4])
        num_slots = num_experts + ep_size * rng.randint(0, 3)
        num_slots += -num_slots % ep_size
        load = [float(rng.randint(0, 3)) if rng.random() < 0.3 else rng.random() ** 4 for _ in range(num_experts)]
        table = list(range(num_experts)) + [rng.randrange(num_experts) for _ in range(num_slots - num_experts)]
        rng.shuffle(table)
        current = ExpertPlacement(table, num_experts, ep_size)
        scratch = ExpertPlacement.balanced(load, num_slots, ep_size, **hierarchy).balancedness(load)
        for compare_to_scratch in (False, True):
            update = replace_experts(current, load, compare_to_scratch=compare_to_scratch, **hierarchy)
            differs = (update.placement.slot_to_expert != current.slot_to_expert).nonzero().flatten().tolist()
            assert list(update.changed_slots) == differs
            if hierarchy:
                assert groups_in_nodes(update.placement, hierarchy["num_groups"], hierarchy["num_nodes"])
            if compare_to_scratch:
                assert update.balancedness_after >= 0.99 * scratch - 1e-12
