"""MoELayer under every EP x ETP layout, slot count, dispatcher and CPU backend against the
single-rank layer without replicas: outputs, input / router / shared-expert gradients, and expert
gradients summed over each expert's replicas. Plus the collectives each paradigm issues, and its host
reads: one per layer forward, none in backward."""

import pytest
import torch

from megamoe.moe.moe_layer import MoEConfig, MoELayer
from megamoe.moe.router import RouterConfig
from tests.helpers.moe_layer import E, F, H, K, T, _check_layer, _config, _inputs


def test_single_rank_dispatchers_backends_and_replicas_agree():
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    for backend in ("torch", "loop"):
        for dispatcher in ("alltoall", "allgather"):
            for num_slots in (E, E + 3, 2 * E):
                _check_layer(state, _config(num_slots, dispatcher, False, backend), check_comms=True)


def test_capacity_factor_drops_overflow_deterministically():
    torch.manual_seed(0)
    layer = MoELayer(_config(capacity_factor=0.5, shared=False))
    x, _ = _inputs()
    routing = layer.router(x)
    slots = layer.experts_to_slots(routing.expert_ids)
    capacity = -(-int(0.5 * T * K) // E)
    kept = slots >= 0
    per_expert = torch.bincount(routing.expert_ids[kept], minlength=E)
    assert per_expert.max() <= capacity and (~kept).any()
    # Earlier tokens win: a kept pair of expert e is never preceded by a dropped pair of e.
    for e in range(E):
        flags = kept[routing.expert_ids == e].tolist()
        assert flags == sorted(flags, reverse=True)
    out1, _ = layer(x)
    out2, _ = layer(x)
    assert torch.equal(out1, out2)
    # Dropless layer differs exactly on tokens that lost a pair.
    dropless = MoELayer(_config(shared=False))
    dropless.load_state_dict(layer.state_dict())
    lost = (~kept).any(dim=1)
    same = torch.isclose(dropless(x)[0], out1, atol=1e-6).all(dim=1)
    assert torch.equal(same, ~lost)


def test_capacity_is_megatrons_get_capacity_in_its_order_of_evaluation():
    """Megatron-Core's get_capacity: ceil((T * K / E) * cf). At cf 1.1, E 160 and T * K 1600 it gives 11;
    ceil(cf * T * K / E) gives 12 (1.1 * 1600 rounds up in floating point)."""
    from megamoe.moe.moe_layer import expert_capacity
    assert expert_capacity(1600, 160, 1.1) == 11
    assert expert_capacity(1600, 160, 1.1, min_capacity=12) == 12 and expert_capacity(1600, 160, 1.1, 4) == 11
    # The layer keeps that many pairs of an expert every token chose: 800 tokens x top-2 over 160 experts.
    router = RouterConfig(hidden_size=4, num_experts=160, top_k=2)
    layer = MoELayer(MoEConfig(router=router, ffn_hidden_size=4, expert_backend="loop", capacity_factor=1.1))
    expert_ids = torch.stack([torch.zeros(800, dtype=torch.long), torch.arange(800) % 159 + 1], dim=1)
    kept = layer.experts_to_slots(expert_ids) >= 0
    assert int(kept[:, 0].sum()) == 11 and kept[:11, 0].all()


def test_config_errors_name_the_field():
    router = RouterConfig(hidden_size=H, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match="num_expert_slots"):
        MoEConfig(router=router, ffn_hidden_size=F, num_expert_slots=E - 1)
    with pytest.raises(ValueError, match="dispatcher"):
        MoEConfig(router=router, ffn_hidden_size=F, dispatcher="broadcast")
    with pytest.raises(ValueError, match="input_sharded"):
        MoEConfig(router=router, ffn_hidden_size=F, input_sharded=True)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEConfig(router=router, ffn_hidden_size=F, capacity_factor=0)


def test_token_mask_keeps_padding_away_from_experts_and_load():
    """Masked-out tokens reach no expert and are not counted; the real tokens' outputs are unchanged."""
    torch.manual_seed(0)
    layer = MoELayer(_config(shared=False, backend="torch"))
    x, _ = _inputs()
    mask = torch.arange(T) % 3 != 0
    layer.load_counter.reset()
    with torch.no_grad():
        masked, _ = layer(x, token_mask=mask)
        counts = layer.load_counter.per_expert.clone(), layer.load_counter.per_slot.clone()
        layer.load_counter.reset()
        real_only, _ = layer(x[mask])
    assert torch.allclose(masked[mask], real_only, atol=1e-6)
    assert torch.equal(counts[0], layer.load_counter.per_expert) and int(counts[0].sum()) == K * int(mask.sum())
    assert torch.equal(counts[1], layer.load_counter.per_slot)
