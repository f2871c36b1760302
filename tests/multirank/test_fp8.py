"""FP8 experts.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_fp8.py."""

from dataclasses import replace

import pytest
import torch

from megamoe.moe.experts.fp8 import FP8Config
from tests.helpers.fp8 import H, RECIPES


# ---- layouts: ETP shards and expert-DP replicas quantise as one rank does ----------------------------
LAYOUT_T, LAYOUT_E, LAYOUT_F = 32, 4, 32


def _moe_fp8_config(recipe):
    from megamoe.moe.moe_layer import MoEConfig
    from megamoe.moe.router import RouterConfig
    return MoEConfig(router=RouterConfig(hidden_size=H, num_experts=LAYOUT_E, top_k=2),
                     ffn_hidden_size=LAYOUT_F, expert_backend="fp8_emulated",
                     expert_fp8=FP8Config(recipe=recipe, amax_history_len=4))


def _fp8_layout_worker(rank, world_size, layout, recipes):
    """Three training steps of an FP8 MoE layer under ``layout`` (2 ranks) against the single-rank layer
    on all the tokens: outputs, input and expert-weight gradients and delayed scales must agree."""
    from megamoe import comms
    from megamoe.moe.moe_layer import MoELayer
    from parallel_state import destroy_model_parallel, initialize_model_parallel

    state = initialize_model_parallel(**layout)
    if state.etp.size > 1:
        # FP8 experts need the slot group once ETP shards a slot; high-precision experts ignore it.
        with pytest.raises(ValueError, match="must contain etp_group .* etp_edp_group="):
            MoELayer(_moe_fp8_config("delayed"), etp_group=state.etp.group)
        MoELayer(replace(_moe_fp8_config("delayed"), expert_backend="torch", expert_fp8=None),
                 etp_group=state.etp.group)
    # Expert-DP ranks take different halves of the tokens; ETP ranks all take every token.
    parts = state.edp.size
    rows = slice(state.edp.rank * LAYOUT_T // parts, (state.edp.rank + 1) * LAYOUT_T // parts)
    worst = {}
    for recipe in recipes:
        config = _moe_fp8_config(recipe)
        torch.manual_seed(7)
        ref = MoELayer(config)
        torch.manual_seed(7)
        layer = MoELayer(config, ep_group=state.ep.group, etp_group=state.etp.group,
                         expert_group=state.ep_etp.group, etp_edp_group=state.etp_edp.group)
        shard_f = LAYOUT_F // state.etp.size
        shard = slice(state.etp.rank * shard_f, (state.etp.rank + 1) * shard_f)
        g = torch.Generator().manual_seed(11)
        worst[recipe] = 0.0
        for step in range(3):
            x, dy = torch.randn(LAYOUT_T, H, generator=g), torch.randn(LAYOUT_T, H, generator=g)
            results = []
            for module, x_in, dy_in in ((ref, x, dy), (layer, x[rows], dy[rows])):
                module.zero_grad(set_to_none=True)
                x_in = x_in.clone().requires_grad_()
                out, _ = module(x_in)
                out.backward(dy_in)
                results.append((out.detach(), x_in.grad))
            (ref_out, ref_dx), (out, dx) = results
            pairs = [("output", out, ref_out[rows]), ("input grad", dx, ref_dx[rows])]
            for slot in range(LAYOUT_E):
                mine = layer.experts.expert_weight_shards(slot, grad=True)
                full = ref.experts.expert_weight_shards(slot, grad=True)
                for name, want in (("gate", full["gate"][shard]), ("down", full["down"][:, shard])):
                    got = comms.all_reduce_(mine[name].clone(), state.edp.group)   # the expert-DP gradient sum
                    pairs.append((f"slot {slot} {name} grad", got, want))
            if recipe == "delayed":
                pairs.append(("delayed scales", layer.experts.fp8_state.scale, ref.experts.fp8_state.scale))
            for what, got, want in pairs:
                error = ((got - want).abs().max() / want.abs().max()).item()
                worst[recipe] = max(worst[recipe], error)
                assert error < 1e-5, f"{recipe}, step {step}, {layout}: {what} differs by {error:.2e} (relative)"
        if recipe == "delayed" and state.edp.size > 1:
            # Training: one all-reduce of the S slot amaxes over ETP x expert-DP per forward operand (fc1 /
            # fc2, input / weight);
            # evaluation reuses the scales and issues no collective at all.
            with comms.comm_counter() as training:
                layer(x[rows])
            layer.eval()
            with comms.comm_counter() as evaluation:
                layer(x[rows])
            assert training.calls("all_reduce", state.etp_edp.group) == 4 == training.calls()
            assert training.bytes("all_reduce") == 4 * LAYOUT_E * 4 and evaluation.calls() == 0
    destroy_model_parallel()
    return worst


@pytest.mark.slow      # ~15 s: two 2-rank layouts, three recipes, three steps each
@pytest.mark.parametrize("layout", [{"etp": 2}, {"tp": 1}], ids=["etp2", "expert_dp2"])
def test_fp8_layer_under_etp_or_expert_dp_quantises_as_one_rank(layout):
    """FP8 amaxes are reduced over the ETP group (shards quantise with the whole tensor's scales) and, for
    the delayed recipe, over the expert-DP group (replicas keep one history): every layout then computes
    what one rank computes on all the tokens, up to fp32 summation order."""
    from megamoe.spawned_ranks import run_on_ranks
    recipes = RECIPES if "etp" in layout else ("delayed",)     # current scaling is per rank's batch under DP
    worst = run_on_ranks(_fp8_layout_worker, 2, args=(layout, recipes), timeout_s=300)
    assert [sorted(w) for w in worst] == [sorted(recipes)] * 2      # every recipe checked on both ranks
