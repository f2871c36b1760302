"""ExpertPlacement (slot tables, replica choice, balanced packing), load counters and the expert-load file."""

import json
import math
import os
import pickle

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from megamoe.moe.placement.expert_slots import (
                                                ExpertLoadCounter,
                                                ExpertPlacement,
                                                load_expert_load,
                                                save_expert_load,
                                                )


def zipf_load(num_experts: int, exponent: float) -> list[float]:
    return [1.0 / (rank + 1) ** exponent for rank in range(num_experts)]


def same_rank_pairs(placement: ExpertPlacement) -> int:
    """Number of extra replicas sharing a rank with a sibling of the same expert."""
    per_rank = placement.slot_to_expert.view(placement.ep_size, placement.slots_per_rank).tolist()
    return sum(len(row) - len(set(row)) for row in per_rank)


def assert_consistent(placement: ExpertPlacement) -> None:
    """The inverse table matches the forward one and every expert has a slot."""
    slot_to_expert = placement.slot_to_expert
    counts = placement.replica_counts
    expert_to_slots = placement.expert_to_slots
    assert slot_to_expert.shape == (placement.num_slots,) and slot_to_expert.dtype == torch.int64
    assert counts.shape == (placement.num_experts,) and bool((counts >= 1).all())
    assert int(counts.sum()) == placement.num_slots
    assert expert_to_slots.shape == (placement.num_experts, int(counts.max()))
    for expert in range(placement.num_experts):
        row = expert_to_slots[expert]
        slots = row[: counts[expert]]
        assert bool((row[counts[expert]:] == -1).all())
        assert slots.tolist() == sorted(slots.tolist())
        assert bool((slot_to_expert[slots] == expert).all())
    assert placement.slots_per_rank * placement.ep_size == placement.num_slots


# ---------------------------------------------------------------------------- tables


def test_default_tables():
    placement = ExpertPlacement.default(num_experts=4, num_slots=6, ep_size=2)
    assert placement.slot_to_expert.tolist() == [0, 1, 2, 3, 0, 1]
    assert placement.replica_counts.tolist() == [2, 2, 1, 1]
    assert placement.expert_to_slots.tolist() == [[0, 4], [1, 5], [2, -1], [3, -1]]
    assert (placement.num_experts, placement.num_slots, placement.ep_size, placement.slots_per_rank) == (4, 6, 2, 3)
    assert placement.local_slots(0) == range(0, 3) and placement.local_slots(1) == range(3, 6)
    assert [placement.slot_owner(s) for s in range(6)] == [0, 0, 0, 1, 1, 1]
    assert placement.slot_owner(torch.tensor(4)) == 1 and isinstance(placement.slot_owner(torch.tensor(4)), int)
    assert placement.slot_owner_tensor(torch.tensor([[5, 0], [3, 2]])).tolist() == [[1, 0], [1, 0]]
    assert_consistent(placement)

    no_replicas = ExpertPlacement.default(8, 8, 4)
    assert no_replicas.expert_to_slots.tolist() == [[e] for e in range(8)]
    assert_consistent(no_replicas)
    # More extra slots than experts: the round-robin wraps.
    wrapped = ExpertPlacement.default(2, 6, 3)
    assert wrapped.slot_to_expert.tolist() == [0, 1, 0, 1, 0, 1]
    assert wrapped.replica_counts.tolist() == [3, 3]


def test_arbitrary_table_and_inverse():
    placement = ExpertPlacement(torch.tensor([2, 0, 2, 1, 2, 0], dtype=torch.int32), num_experts=3, ep_size=3)
    assert placement.replica_counts.tolist() == [2, 1, 3]
    assert placement.expert_to_slots.tolist() == [[1, 5, -1], [3, -1, -1], [0, 2, 4]]
    assert_consistent(placement)


def test_placement_is_immutable():
    placement = ExpertPlacement.default(4, 6, 2)
    with pytest.raises(AttributeError, match="immutable"):
        placement.num_slots = 8
    placement.slot_to_expert[0] = 3
    placement.expert_to_slots.fill_(0)
    assert placement == ExpertPlacement.default(4, 6, 2)
    assert_consistent(placement)


def test_equality_hash_repr_pickle():
    a = ExpertPlacement.default(4, 6, 2)
    b = ExpertPlacement([0, 1, 2, 3, 0, 1], 4, 2)
    assert a == b and hash(a) == hash(b)
    assert a != ExpertPlacement([0, 1, 2, 3, 2, 3], 4, 2)
    assert a != ExpertPlacement([0, 1, 2, 3, 0, 1], 4, 3)
    assert a != "not a placement"
    assert repr(a) == "ExpertPlacement(num_experts=4, num_slots=6, ep_size=2, replicas={0: 2, 1: 2})"
    assert pickle.loads(pickle.dumps(a)) == a


# ---------------------------------------------------------------------------- choose_slots


def test_choose_slots_returns_slots_of_the_routed_expert_deterministically():
    placement = ExpertPlacement([3, 0, 1, 3, 2, 0, 3, 1], num_experts=4, ep_size=2)
    generator = torch.Generator().manual_seed(0)
    expert_ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(64)])  # [T, K]
    positions = torch.arange(100, 164)
    slots = placement.choose_slots(expert_ids, positions)
    assert slots.shape == expert_ids.shape and slots.dtype == torch.int64
    assert torch.equal(placement.slot_to_expert[slots], expert_ids)
    assert torch.equal(placement.choose_slots(expert_ids, positions), slots)
    # Narrow integer dtypes give the same answer.
    assert torch.equal(placement.choose_slots(expert_ids.int(), positions.int()), slots)
    assert placement.choose_slots(expert_ids[:0], positions[:0]).shape == (0, 2)  # a rank with no tokens


def test_choose_slots_without_replicas_needs_no_positions():
    # One slot per expert, in a shuffled order: the slot of each pair is the expert's only slot.
    placement = ExpertPlacement([2, 0, 3, 1], num_experts=4, ep_size=2)
    expert_ids = torch.tensor([[0, 3], [2, 1], [1, 0]])
    slots = placement.choose_slots(expert_ids)
    assert torch.equal(placement.slot_to_expert[slots], expert_ids) and slots.dtype == torch.int64
    assert torch.equal(placement.choose_slots(expert_ids.int(), torch.arange(3)), slots)
    with pytest.raises(ValueError, match="integer"):
        placement.choose_slots(expert_ids.float())
    replicated = ExpertPlacement([0, 1, 2, 3, 0, 1], num_experts=4, ep_size=2)
    with pytest.raises(ValueError, match="token_positions are required"):
        replicated.choose_slots(expert_ids)


def test_choose_slots_depends_only_on_position_and_expert():
    placement = ExpertPlacement.balanced(zipf_load(8, 1.5), num_slots=16, ep_size=4)
    generator = torch.Generator().manual_seed(1)
    expert_ids = torch.stack([torch.randperm(8, generator=generator)[:3] for _ in range(50)])  # [T, K]
    positions = torch.randperm(1000, generator=generator)[:50]
    slots = placement.choose_slots(expert_ids, positions)
    # Shuffling tokens, or the order of a token's K experts, moves each pair's slot with it.
    token_order = torch.randperm(50, generator=generator)
    assert torch.equal(placement.choose_slots(expert_ids[token_order], positions[token_order]), slots[token_order])
    assert torch.equal(placement.choose_slots(expert_ids.flip(1), positions), slots.flip(1))
    # A token seen alone (e.g. in a different batch) keeps its slots.
    for token in (0, 17, 49):
        alone = placement.choose_slots(expert_ids[token:token + 1], positions[token:token + 1])
        assert torch.equal(alone[0], slots[token])


def test_choose_slots_spreads_consecutive_tokens_evenly_over_replicas():
    placement = ExpertPlacement.default(num_experts=5, num_slots=12, ep_size=4)  # replicas 3, 3, 2, 2, 2
    for expert in range(5):
        for start, length in ((0, 30), (7, 13), (1001, 5)):
            positions = torch.arange(start, start + length)
            slots = placement.choose_slots(torch.full((length, 1), expert), positions)
            replicas = placement.expert_to_slots[expert, : placement.replica_counts[expert]]
            per_replica = torch.stack([(slots == s).sum() for s in replicas])
            assert int(per_replica.sum()) == length
            assert int(per_replica.max() - per_replica.min()) <= 1, (expert, start, per_replica.tolist())


def owned_pairs_per_rank(placement: ExpertPlacement, slots_per_rank_view: list[torch.Tensor]) -> list[int]:
    """How many (token, expert) pairs each rank would compute, given the slots that rank chose."""
    return [
        int(((slots >= placement.local_slots(rank).start) & (slots < placement.local_slots(rank).stop)).sum())
        for rank, slots in enumerate(slots_per_rank_view)
    ]


def test_every_rank_picks_the_same_slots_so_no_pair_is_counted_twice():
    # All-gather paradigm, simulated in-process: both ranks see the same tokens, each computes the pairs
    # whose chosen slot it owns. Expert 0 has a replica on each rank.
    placement = ExpertPlacement([0, 1, 2, 0, 3, 4], num_experts=5, ep_size=2)
    expert_ids = torch.tensor([[0, 1], [0, 3], [2, 0], [4, 0], [0, 2], [1, 4]])  # [T, K]
    positions = torch.arange(6)
    chosen = [placement.choose_slots(expert_ids, positions) for _ in range(2)]
    assert torch.equal(chosen[0], chosen[1])
    assert sum(owned_pairs_per_rank(placement, chosen)) == expert_ids.numel()

    # A per-rank rule ("use my own replica when I have one") double counts every pair of expert 0.
    def prefer_local_replica(rank: int) -> torch.Tensor:
        slots = placement.choose_slots(expert_ids, positions)
        local_replica_of_0 = [s for s in placement.local_slots(rank) if placement.slot_to_expert[s] == 0][0]
        return torch.where(expert_ids == 0, torch.tensor(local_replica_of_0), slots)

    per_rank_rule = [prefer_local_replica(rank) for rank in range(2)]
    double_counted = int((expert_ids == 0).sum())
    assert sum(owned_pairs_per_rank(placement, per_rank_rule)) == expert_ids.numel() + double_counted


def test_sharded_tokens_with_global_positions_match_the_full_batch():
    # Sequence-parallel style: each rank holds a shard of the tokens and passes global positions.
    placement = ExpertPlacement.balanced(zipf_load(16, 1.2), num_slots=24, ep_size=4)
    generator = torch.Generator().manual_seed(2)
    expert_ids = torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(40)])
    positions = torch.arange(40)
    full = placement.choose_slots(expert_ids, positions)
    shards = [placement.choose_slots(expert_ids[i:i + 10], positions[i:i + 10]) for i in range(0, 40, 10)]
    assert torch.equal(torch.cat(shards), full)


def test_choose_slots_rejects_bad_shapes_and_dtypes():
    placement = ExpertPlacement.default(4, 4, 2)
    with pytest.raises(ValueError, match=r"expert_ids must be \[T, K\]"):
        placement.choose_slots(torch.zeros(4, dtype=torch.long), torch.arange(4))
    with pytest.raises(ValueError, match=r"token_positions must be \[T\]"):
        placement.choose_slots(torch.zeros(4, 2, dtype=torch.long), torch.arange(5))
    with pytest.raises(ValueError, match="integer tensor"):
        placement.choose_slots(torch.zeros(4, 2), torch.arange(4))


# ---------------------------------------------------------------------------- balanced placement


def test_load_accounting():
    placement = ExpertPlacement([0, 1, 0, 2], num_experts=3, ep_size=2)
    # Expert 0's load 4 splits over its two replicas: rank 0 = 2 + 1, rank 1 = 2 + 3.
    assert placement.rank_loads([4.0, 1.0, 3.0]).tolist() == [3.0, 5.0]
    assert placement.balancedness(torch.tensor([4, 1, 3])) == pytest.approx(4.0 / 5.0)
    assert placement.balancedness([0.0, 0.0, 0.0]) == 1.0


def test_balanced_beats_default_on_zipf_load(record_property):
    load = zipf_load(64, 1.2)
    balanced = ExpertPlacement.balanced(load, num_slots=80, ep_size=8)
    default = ExpertPlacement.default(64, 80, 8)
    balanced_score, default_score = balanced.balancedness(load), default.balancedness(load)
    record_property("balancedness_balanced", balanced_score)
    record_property("balancedness_default", default_score)
    print(f"Zipf(1.2), 64 experts, 80 slots, 8 ranks: balanced {balanced_score:.4f}, default {default_score:.4f}")
    assert_consistent(balanced)
    assert balanced_score >= 0.95
    assert balanced_score > default_score
    # The hottest expert got the most replicas, and no rank holds two replicas of an expert that has at
    # most one per rank.
    assert int(balanced.replica_counts.argmax()) == 0
    assert same_rank_pairs(balanced) == 0
    assert ExpertPlacement.balanced(load, num_slots=80, ep_size=8) == balanced  # deterministic


def test_balanced_edge_cases():
    # No extra slots: a pure packing problem.
    placement = ExpertPlacement.balanced([8, 7, 6, 5, 4, 3, 2, 1], num_slots=8, ep_size=4)
    assert placement.rank_loads([8, 7, 6, 5, 4, 3, 2, 1]).tolist() == [9.0] * 4
    # All-zero load replicates round-robin rather than onto one expert.
    zero = ExpertPlacement.balanced([0.0] * 4, num_slots=8, ep_size=2)
    assert zero.replica_counts.tolist() == [2, 2, 2, 2]
    assert same_rank_pairs(zero) == 0
    # One hot expert: one replica per rank before any rank gets a second.
    hot = ExpertPlacement.balanced([0.0, 0.0, 0.0, 1.0], num_slots=8, ep_size=2)
    assert hot.rank_loads([0.0, 0.0, 0.0, 1.0]).tolist() == [0.5, 0.5]
    # A single rank and a single expert.
    assert ExpertPlacement.balanced([5.0], num_slots=3, ep_size=1).slot_to_expert.tolist() == [0, 0, 0]


def test_hierarchical_keeps_groups_and_replicas_inside_nodes():
    num_experts, num_groups, num_nodes, ep_size, num_slots = 32, 8, 2, 8, 48
    generator = torch.Generator().manual_seed(3)
    load = torch.rand(num_experts, generator=generator, dtype=torch.float64) ** 4 * 100
    placement = ExpertPlacement.balanced(load, num_slots, ep_size, num_groups=num_groups, num_nodes=num_nodes)
    assert_consistent(placement)
    experts_per_group, slots_per_node = num_experts // num_groups, num_slots // num_nodes
    node_of_slot = torch.arange(num_slots) // slots_per_node
    slot_to_expert = placement.slot_to_expert
    for group in range(num_groups):
        in_group = (slot_to_expert // experts_per_group) == group
        assert len(set(node_of_slot[in_group].tolist())) == 1, f"group {group} spans nodes"
    # Each node takes num_groups / num_nodes whole groups.
    for node in range(num_nodes):
        groups = set((slot_to_expert[node_of_slot == node] // experts_per_group).tolist())
        assert len(groups) == num_groups // num_nodes
    assert placement == ExpertPlacement.balanced(load, num_slots, ep_size, num_groups=num_groups, num_nodes=num_nodes)
    flat_score = ExpertPlacement.balanced(load, num_slots, ep_size).balancedness(load)
    hierarchical_score = placement.balancedness(load)
    print(f"hierarchical {hierarchical_score:.4f}, flat {flat_score:.4f}")
    assert hierarchical_score >= 0.8


def test_hierarchical_balances_groups_over_nodes():
    # Group loads 4, 3, 3, 2 (experts of equal load within a group): the only balanced split is {4, 2} | {3, 3}.
    load = [2.0, 2.0, 1.5, 1.5, 1.5, 1.5, 1.0, 1.0]
    placement = ExpertPlacement.balanced(load, num_slots=8, ep_size=4, num_groups=4, num_nodes=2)
    assert placement.rank_loads(load).tolist() == [3.0, 3.0, 3.0, 3.0]
    # One group on one node is the flat policy.
    assert ExpertPlacement.balanced(load, 12, 4, num_groups=1, num_nodes=1) == ExpertPlacement.balanced(load, 12, 4)


@st.composite
def placement_problems(draw):
    num_experts = draw(st.integers(1, 16))
    ep_size = draw(st.integers(1, 8))
    num_slots = math.ceil(num_experts / ep_size) * ep_size + ep_size * draw(st.integers(0, 3))
    value = st.one_of(st.integers(0, 1000).map(float), st.floats(0.0, 1e6, allow_subnormal=False))
    load = draw(st.lists(value, min_size=num_experts, max_size=num_experts))
    return load, num_slots, ep_size


@settings(max_examples=150, deadline=None)
@given(placement_problems())
# Lumpy loads on which the packing heuristic alone loses to the default layout (5 equal replicas on 2 ranks).
@example(([0.0, 1.0, 2.0, 0.0, 0.0, 2.0], 8, 2))
def test_balanced_property(problem):
    load, num_slots, ep_size = problem
    placement = ExpertPlacement.balanced(load, num_slots, ep_size)
    assert_consistent(placement)
    assert placement.num_slots == num_slots and placement.slots_per_rank == num_slots // ep_size
    assert len(placement.rank_loads(load)) == ep_size
    default = ExpertPlacement.default(len(load), num_slots, ep_size)
    assert placement.balancedness(load) >= default.balancedness(load) - 1e-12


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 2), st.integers(1, 4), st.integers(0, 2), st.data())
def test_hierarchical_property(nodes, groups_per_node, ranks_per_node, experts_per_group, extra_per_rank, data):
    num_nodes, num_groups = nodes, nodes * groups_per_node
    num_experts, ep_size = num_groups * experts_per_group, nodes * ranks_per_node
    num_slots = math.ceil(num_experts / ep_size) * ep_size + extra_per_rank * ep_size
    load = data.draw(st.lists(st.integers(0, 100).map(float), min_size=num_experts, max_size=num_experts))
    placement = ExpertPlacement.balanced(load, num_slots, ep_size, num_groups=num_groups, num_nodes=num_nodes)
    assert_consistent(placement)
    node_of_slot = torch.arange(num_slots) // (num_slots // num_nodes)
    for expert in range(num_experts):
        slots = placement.expert_to_slots[expert, : placement.replica_counts[expert]]
        assert len(set(node_of_slot[slots].tolist())) == 1


# ---------------------------------------------------------------------------- serialisation


def test_placement_dict_round_trip_through_json():
    placement = ExpertPlacement.balanced(zipf_load(16, 1.0), num_slots=20, ep_size=4)
    d = placement.to_dict()
    assert d["num_experts"] == 16 and d["ep_size"] == 4 and len(d["slot_to_expert"]) == 20
    restored = ExpertPlacement.from_dict(json.loads(json.dumps(d)))
    assert restored == placement


def test_expert_load_file_round_trip(tmp_path):
    path = tmp_path / "load.json"
    loads = {3: torch.tensor([5, 0, 2, 1]), 0: [0.25, 0.25, 0.5, 0.0]}
    save_expert_load(path, loads, num_experts=4, metadata={"tokens": 8, "model": "tiny"})
    document = json.loads(path.read_text())
    assert document["format"] == "megamoe-expert-load" and document["version"] == 1
    assert document["num_experts"] == 4 and list(document["layers"]) == ["0", "3"]
    assert document["metadata"] == {"tokens": 8, "model": "tiny"}
    restored = load_expert_load(path)
    assert list(restored) == [0, 3]
    assert restored[3].dtype == torch.float64 and restored[3].tolist() == [5.0, 0.0, 2.0, 1.0]
    assert restored[0].tolist() == [0.25, 0.25, 0.5, 0.0]
    # Overwriting replaces the file atomically and leaves no temporary behind.
    save_expert_load(path, {1: [1, 1, 1, 1]}, num_experts=4)
    assert list(load_expert_load(path)) == [1]
    assert os.listdir(tmp_path) == ["load.json"]


def test_failed_save_keeps_the_old_file(tmp_path):
    path = tmp_path / "load.json"
    save_expert_load(path, {0: [1.0, 2.0]}, num_experts=2)
    with pytest.raises(ValueError, match="metadata is not JSON-serialisable"):
        save_expert_load(path, {0: [3.0, 4.0]}, num_experts=2, metadata={"bad": object()})
    assert load_expert_load(path)[0].tolist() == [1.0, 2.0]
    assert os.listdir(tmp_path) == ["load.json"]


# ---------------------------------------------------------------------------- counters


def test_load_counter():
    counter = ExpertLoadCounter(num_experts=4, num_slots=6)
    placement = ExpertPlacement.default(4, 6, 2)
    expert_ids = torch.tensor([[0, 1], [0, 3], [1, 0]])
    with torch.enable_grad():
        counter.record(expert_ids, placement.choose_slots(expert_ids, torch.arange(3)))
    counter.record(torch.tensor([[2, 0]]))
    assert counter.per_expert.tolist() == [4, 2, 1, 1]
    assert counter.per_expert.dtype == torch.int64 and not counter.per_expert.requires_grad
    # Replica (position + expert) % 2: expert 0 at positions 0, 1, 2 -> slots 0, 4, 0; expert 1 at
    # positions 0, 2 -> replica 1 both times -> slot 5; expert 3 -> slot 3.
    assert counter.per_slot.tolist() == [2, 0, 0, 1, 1, 2]
    counter.reset()
    assert counter.per_expert.tolist() == [0] * 4 and counter.per_slot.tolist() == [0] * 6
    # Slot -1 marks a pair dropped by the capacity limit: the expert was still asked for, no slot ran it.
    counter.record(torch.tensor([[1, 2], [1, 3]]), torch.tensor([[1, -1], [-1, 3]]))
    assert counter.per_expert.tolist() == [0, 2, 1, 1] and counter.per_slot.tolist() == [0, 1, 0, 1, 0, 0]
    with pytest.raises(ValueError, match="slot_ids shape"):
        counter.record(expert_ids, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor"):
        counter.record(expert_ids.float())


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ExpertPlacement.default(4, 6, 4), "not a multiple of ep_size"),
        (lambda: ExpertPlacement([0, 1, 2, 0, 1, 2], 3, 4), "not a multiple of ep_size"),
        (lambda: ExpertPlacement.default(8, 4, 2), r"num_slots \(4\) < num_experts \(8\)"),
        (lambda: ExpertPlacement([0, 1, 1, 1], 3, 2), r"experts \[2\] have no slot"),
        (lambda: ExpertPlacement([0, 1, 4, 2], 4, 2), r"slot_to_expert\[2\] = 4 is not an expert id"),
        (lambda: ExpertPlacement([0, -1, 1, 2], 3, 2), r"slot_to_expert\[1\] = -1"),
        (lambda: ExpertPlacement([0, 1.5], 2, 1), r"slot_to_expert\[1\] must be an integer"),
        (lambda: ExpertPlacement(torch.tensor([0.0, 1.0]), 2, 1), "integer expert ids"),
        (lambda: ExpertPlacement(torch.zeros(2, 2, dtype=torch.long), 2, 1), "1-D"),
        (lambda: ExpertPlacement([0, 1], 0, 1), "num_experts must be >= 1"),
        (lambda: ExpertPlacement([0, 1], 2, True), "ep_size must be a positive integer"),
        (lambda: ExpertPlacement.balanced([1.0, 2.0], 3, 2), "not a multiple of ep_size"),
        (lambda: ExpertPlacement.balanced([1.0, -2.0], 2, 2), r"expert_load\[1\] is negative"),
        (lambda: ExpertPlacement.balanced([1.0, math.nan], 2, 2), "NaN or infinite"),
        (lambda: ExpertPlacement.balanced([], 2, 2), "non-empty 1-D"),
        (lambda: ExpertPlacement.balanced([1.0] * 4, 4, 2, num_groups=2), "give both or neither"),
        (lambda: ExpertPlacement.balanced([1.0] * 4, 4, 2, num_groups=3, num_nodes=1), "multiple of num_groups"),
        (lambda: ExpertPlacement.balanced([1.0] * 4, 4, 2, num_groups=2, num_nodes=4), "multiple of num_nodes"),
        (
            lambda: ExpertPlacement.balanced([1.0] * 6, 6, 3, num_groups=2, num_nodes=2),
            r"ep_size \(3\) is not a multiple",
        ),
        (lambda: ExpertPlacement.default(2, 2, 2).rank_loads([1.0, 2.0, 3.0]), "has 3 entries but there are 2 experts"),
        (lambda: ExpertPlacement.default(2, 2, 2).local_slots(2), r"ep_rank must be an integer in \[0, 2\)"),
        (lambda: ExpertPlacement.default(2, 2, 2).slot_owner(-1), r"slot must be an integer in \[0, 2\)"),
        (lambda: ExpertPlacement.default(2, 2, 2).slot_owner(1.0), r"slot must be an integer in \[0, 2\)"),
        (lambda: ExpertPlacement.from_dict([0, 1]), "must be a dict"),
        (lambda: ExpertPlacement.from_dict({"num_experts": 2, "slot_to_expert": [0, 1]}), r"missing \['ep_size'\]"),
        (
            lambda: ExpertPlacement.from_dict({"num_experts": 2, "ep_size": 1, "slot_to_expert": [0, 1], "x": 1}),
            r"unknown \['x'\]",
        ),
        (lambda: ExpertPlacement.from_dict({"num_experts": 2, "ep_size": 1, "slot_to_expert": "01"}), "list of ints"),
        (lambda: ExpertPlacement.from_dict({"num_experts": 3, "ep_size": 1, "slot_to_expert": [0, 1]}), "num_slots"),
        (lambda: ExpertLoadCounter(4, 2), r"num_slots \(2\) < num_experts \(4\)"),
    ],
)
def test_validation_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(
    "loads, kwargs, message",
    [
        ({0: [1.0, 2.0, 3.0]}, {"num_experts": 2}, r"loads\[0\] has 3 entries"),
        ({0: [1.0, -1.0]}, {"num_experts": 2}, "negative"),
        ({0: [1.0, math.inf]}, {"num_experts": 2}, "NaN or infinite"),
        ({-1: [1.0, 1.0]}, {"num_experts": 2}, "non-negative ints"),
        ({"0": [1.0, 1.0]}, {"num_experts": 2}, "non-negative ints"),
        ({}, {"num_experts": 2}, "non-empty dict"),
        ({0: [1.0, 1.0]}, {"num_experts": 2, "metadata": ["a"]}, "metadata must be a dict"),
    ],
)
def test_save_expert_load_validation(tmp_path, loads, kwargs, message):
    with pytest.raises(ValueError, match=message):
        save_expert_load(tmp_path / "load.json", loads, **kwargs)
    assert os.listdir(tmp_path) == []


def valid_document() -> dict:
    return {"format": "megamoe-expert-load", "version": 1, "num_experts": 2, "layers": {"0": [1, 2.5]}, "metadata": {}}


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: "not json {", "is not valid JSON"),
        (lambda d: [d], "JSON object at the top level"),
        (lambda d: {**d, "format": "other"}, "'format' is 'other'"),
        (lambda d: {**d, "version": 2}, "unsupported version 2"),
        (lambda d: {**d, "num_experts": "2"}, "'num_experts' must be a positive int"),
        (lambda d: {**d, "metadata": 3}, "'metadata' must be an object"),
        (lambda d: {**d, "layers": {}}, "'layers' must be a non-empty object"),
        (lambda d: {**d, "layers": {"first": [1, 2]}}, "layer key 'first' is not a layer index"),
        (lambda d: {**d, "layers": {"01": [1, 2]}}, "layer key '01'"),
        (lambda d: {**d, "layers": {"0": [1, "2"]}}, "layer 0 must be a list of numbers"),
        (lambda d: {**d, "layers": {"0": [1, True]}}, "layer 0 must be a list of numbers"),
        (lambda d: {**d, "layers": {"0": [1, 2, 3]}}, "layer 0 has 3 entries but there are 2 experts"),
        (lambda d: {**d, "layers": {"0": [1, -2]}}, "negative"),
    ],
)
def test_load_expert_load_validation(tmp_path, edit, message):
    path = tmp_path / "load.json"
    content = edit(valid_document())
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load_expert_load(path)


def test_load_expert_load_rejects_nan(tmp_path):
    path = tmp_path / "load.json"
    path.write_text(json.dumps(valid_document()).replace("2.5", "NaN"))
    with pytest.raises(ValueError, match="NaN or infinite"):
        load_expert_load(path)


def test_balanced_packing_puts_balance_before_separating_replicas():
    """Regression (issue #18): starting the packing from a replica-separating greedy trapped the swaps at
    balancedness 0.987 for a Zipf(1.5) load over 64 experts, 72 slots, EP 8; 0.9999 is reachable."""
    load = [1 / (i + 1) ** 1.5 for i in range(64)]
    placement = ExpertPlacement.balanced(load, 72, 8)
    assert placement.balancedness(load) >= 0.9995


def test_balanced_replica_counts_follow_the_packing():
    """Regression (issue #18): the one-replica-per-rank cap chose [2, 4, 2] replicas for loads [33, 68, 17]
    on 8 slots over 4 ranks (balancedness 0.881); [2, 5, 1] packs to 0.964."""
    load = [33.0, 68.0, 17.0]
    placement = ExpertPlacement.balanced(load, 8, 4)
    assert placement.replica_counts.tolist() == [2, 5, 1]
    assert placement.balancedness(load) == pytest.approx((33 + 68 + 17) / 4 / (17 + 68 / 5))
