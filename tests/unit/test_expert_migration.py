"""Expert migration (megamoe.moe.placement.expert_migration).

The in-process cases; those that spawn ranks or run scripts end to end are in
tests/multirank/test_expert_migration.py."""

import pytest
import torch

from megamoe import comms
from megamoe.moe.placement.expert_migration import MigrationStats, migrate_layer, plan_migration
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.moe.experts.fp8 import FP8Config
from megamoe.moe.moe_layer import MoELayer
from tests.helpers.expert_migration import E, H, T, _config


# ----------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------
def test_plan_spreads_the_senders_over_old_replicas():
    old = ExpertPlacement([0, 1, 2, 3, 0, 1, 2, 3], 4, 4)          # ranks: [0 1] [2 3] [0 1] [2 3]
    new = ExpertPlacement([2, 3, 0, 1, 2, 3, 0, 1], 4, 4)          # every rank wants the other pair
    plan = plan_migration(old, new)
    assert plan.changed_slots == tuple(range(8)) and not plan.local_sources
    assert sorted((t.dst_rank, t.expert) for t in plan.transfers) == [
        (r, e) for r in range(4) for e in ((2, 3) if r % 2 == 0 else (0, 1))]
    assert all(int(old.slot_to_expert[t.src_slot]) == t.expert for t in plan.transfers)
    sends = [sum(old.slot_owner(t.src_slot) == r for t in plan.transfers) for r in range(4)]
    assert sends == [2, 2, 2, 2]                                   # two old replicas each: spread evenly
    assert plan == plan_migration(old, new)                        # deterministic


def test_plan_copies_locally_and_sends_an_expert_once_per_rank():
    old = ExpertPlacement([0, 1, 2, 3, 0, 1], 4, 2)                # ranks: [0 1 2] [3 0 1]
    new = ExpertPlacement([3, 3, 2, 0, 1, 1], 4, 2)
    plan = plan_migration(old, new)
    assert plan.changed_slots == (0, 1, 3, 4)
    assert plan.local_sources == {3: 4, 4: 5}                      # rank 1: 0 from slot 4, 1 from slot 5
    transfer, = plan.transfers                                     # rank 0 wants expert 3 in slots 0 and 1: once,
    assert (transfer.expert, transfer.src_slot, transfer.dst_rank, transfer.dst_slots) == (3, 3, 0, (0, 1))
    # ...from slot 3, whose old contents are read although slot 3 itself changes.


def test_single_rank_migration_is_local_copies_and_keeps_weights_state_and_function():
    torch.manual_seed(0)
    layer = MoELayer(_config(12, backend="loop"))
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        out, _ = layer(torch.randn(T, H))
        out.square().sum().backward()
        layer.reduce_replica_grads()
        optimizer.step()
    x = torch.randn(T, H)
    before = layer(x)[0].detach()
    expert_state = {int(e): [t[s].clone() for p in (layer.experts.w_gate_up, layer.experts.w_down)
                             for t in (p.detach(), optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])]
                    for s, e in enumerate(layer.placement.slot_to_expert.tolist())}
    new = [7, 6, 5, 4, 3, 2, 1, 0, 7, 7, 0, 4]         # every slot changes
    with comms.comm_counter() as counter:
        stats = migrate_layer(layer, ExpertPlacement(new, E, 1), optimizer)
    assert counter.calls() == 0
    assert stats == MigrationStats(moved_slots=0, local_copies=12, moved_bytes=0)
    for s, e in enumerate(new):
        now = [t[s] for p in (layer.experts.w_gate_up, layer.experts.w_down)
               for t in (p.detach(), optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])]
        assert all(torch.equal(a, b) for a, b in zip(now, expert_state[e])), f"slot {s}"
    torch.testing.assert_close(layer(x)[0].detach(), before, rtol=1e-6, atol=1e-7)


def test_fp8_scaling_state_moves_with_the_weights():
    """Delayed scaling: a slot goes on quantising as its source slot did, so the output is unchanged."""
    torch.manual_seed(0)
    layer = MoELayer(_config(8, backend="fp8_emulated", fp8=FP8Config(recipe="delayed", amax_history_len=4)))
    for _ in range(2):
        out, _ = layer(torch.randn(T, H))
        out.sum().backward()
    x = torch.randn(T, H)
    layer.eval()
    before = layer(x)[0].detach()
    fp8 = layer.experts.fp8_state
    history, scale = fp8.amax_history.clone(), fp8.scale.clone()
    assert not torch.equal(scale[:, 0], scale[:, 1])                   # slots were scaled differently
    new = [1, 0, 2, 3, 4, 5, 7, 6]
    migrate_layer(layer, ExpertPlacement(new, E, 1))
    assert torch.equal(fp8.amax_history, history[:, new]) and torch.equal(fp8.scale, scale[:, new])
    torch.testing.assert_close(layer(x)[0].detach(), before, rtol=1e-6, atol=1e-7)


def test_bad_placements_and_optimizer_state_are_refused_naming_the_problem():
    layer = MoELayer(_config(8))
    with pytest.raises(ValueError, match="9 slots .* 8 .* same number of experts, slots and EP ranks"):
        migrate_layer(layer, ExpertPlacement([0, 1, 2, 3, 4, 5, 6, 7, 0], E, 1))
    with pytest.raises(ValueError, match="must be an ExpertPlacement"):
        migrate_layer(layer, [1, 0, 2, 3, 4, 5, 6, 7])
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    optimizer.state[layer.experts.w_down]["row_scale"] = torch.ones(8)
    with pytest.raises(ValueError, match="'row_scale' .* shape \\[8\\]"):
        migrate_layer(layer, ExpertPlacement([1, 0, 2, 3, 4, 5, 6, 7], E, 1), optimizer)
    assert layer.placement == ExpertPlacement.default(E, 8, 1)         # nothing changed
    with pytest.raises(ValueError, match="1-D uint8"):
        comms.exchange_expert_slots(torch.zeros(4), [16], [16], None)
    with pytest.raises(ValueError, match="one byte count per rank"):
        comms.exchange_expert_slots(torch.zeros(4, dtype=torch.uint8), [3], [4], None)
