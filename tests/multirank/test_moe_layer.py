"""MoELayer under every EP x ETP layout, slot count, dispatcher and CPU backend against the
single-rank layer without replicas: outputs, input / router / shared-expert gradients, and expert
gradients summed over each expert's replicas. Plus the collectives each paradigm issues, and its host
reads: one per layer forward, none in backward.

The cases that spawn ranks or run scripts end to end; the in-process ones are in tests/unit/test_moe_layer.py."""

import pytest
import torch

from megamoe.moe.moe_layer import MoEConfig, MoELayer
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.spawned_ranks import run_on_ranks
from tests.helpers.moe_layer import E, F, H, T, _check_layer, _config, _inputs
from tests.helpers.moe_layer import _check_autocast_exchanges_the_compute_dtype


def _check_combine_sums(state):
    """EP > 1, all-to-all: (1) the combine adds each token's returned partial sums and the shared output in fp32
    and rounds once: partial sums 1 (from rank 0) and 2^-8 (rank 1) and a shared output of 2^-8 give 1 + 2^-7 in
    bf16, where adding them in bf16 gave 1 (each 2^-8 is half an ulp); (2) the deterministic layer equals the
    default one bit for bit (output and every gradient)."""
    from megamoe.moe.token_dispatcher import AllToAllDispatcher
    step = 2.0 ** -8
    dispatcher = AllToAllDispatcher(2 * state.ep.size, ep_group=state.ep.group)
    slot_ids = torch.tensor([[0, 2]])                         # slot 0 on rank 0, slot 2 on rank 1
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    expert_input, _ = dispatcher.dispatch(x, slot_ids, torch.ones(1, 2))
    partial = torch.full_like(expert_input, 1.0 if state.ep.rank == 0 else step)
    out = dispatcher.combine(partial, torch.full((1, 4), step, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.tolist() == [[1.0 + 2 * step] * 4], out

    x, dy = _inputs()
    rows = slice(state.ep.rank * T // state.ep.size, (state.ep.rank + 1) * T // state.ep.size)
    results = []
    for deterministic in (False, True):
        config = MoEConfig(                                   # top-3: 3 terms per token, the order of the sum shows
            router=RouterConfig(hidden_size=H, num_experts=E, top_k=3, norm_topk_prob=True), ffn_hidden_size=F,
            num_expert_slots=2 * E, expert_backend="torch", shared_experts=SharedExpertsConfig(H, 2 * F, gate=True),
            deterministic=deterministic)
        torch.manual_seed(7)
        layer = MoELayer(config, ep_group=state.ep.group, etp_group=state.etp.group, expert_group=state.ep_etp.group)
        x_local = x[rows].clone().requires_grad_()
        out, _ = layer(x_local)
        out.backward(dy[rows])
        results.append([out, x_local.grad, *(p.grad for p in layer.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results))


LAYOUTS = [dict(ep=2, etp=1), dict(ep=4, etp=1), dict(ep=1, etp=2), dict(ep=2, etp=2)]


def _layouts_worker(rank, world_size, backends):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    checked = 0
    for layout in LAYOUTS:
        state = initialize_model_parallel(**layout)
        ep = layout["ep"]
        if ep > 1:
            _check_combine_sums(state)
            _check_autocast_exchanges_the_compute_dtype(state)
        for num_slots in (E, E + ep, 2 * E):
            for dispatcher, sharded in (("alltoall", False), ("allgather", False), ("allgather", True)):
                for backend in backends:
                    _check_layer(state, _config(num_slots, dispatcher, sharded, backend),
                                 check_comms=backend == backends[0])
                    checked += 1
        destroy_model_parallel()
    return checked


@pytest.mark.slow
def test_moe_layer_matches_single_rank_on_every_layout():
    counts = run_on_ranks(_layouts_worker, 4, args=(("torch", "loop"),), timeout_s=600)
    assert counts == [len(LAYOUTS) * 3 * 3 * 2] * 4
