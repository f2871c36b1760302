"""MoELayer under every EP x ETP layout, slot count, dispatcher and CPU backend against the
single-rank layer without replicas: outputs, input / router / shared-expert gradients, and expert
gradients summed over each expert's replicas. Plus the collectives each paradigm issues, and its host
reads: one per layer forward, none in backward."""

import pytest
import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.host_values import count_host_reads
from megamoe.moe.moe_layer import MoEConfig, MoELayer
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.spawned_ranks import run_on_ranks

T, H, F, E, K = 24, 16, 8, 8, 2
ATOL = 2e-5


def _config(num_slots=None, dispatcher="alltoall", input_sharded=False, backend="loop", shared=True,
            capacity_factor=None):
    return MoEConfig(
        router=RouterConfig(hidden_size=H, num_experts=E, top_k=K, norm_topk_prob=True),
        ffn_hidden_size=F, num_expert_slots=num_slots, dispatcher=dispatcher, input_sharded=input_sharded,
        expert_backend=backend, capacity_factor=capacity_factor,
        shared_experts=SharedExpertsConfig(H, 2 * F, gate=True) if shared else None)


def _inputs():
    g = torch.Generator().manual_seed(123)
    return torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)


def _expert_grads(layer: MoELayer) -> dict[int, dict[str, torch.Tensor]]:
    """expert id -> {gate, up, down} gradient of this rank's shards, summed over its local replicas,
    placed in full-size (unsharded) HF-layout tensors (zeros outside this rank's ETP shard)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    shard_f = F // layer.etp_size
    lo, hi = layer.etp_rank * shard_f, (layer.etp_rank + 1) * shard_f
    for local_slot, slot in enumerate(layer.local_slots):
        expert = int(layer.placement.slot_to_expert[slot])
        grads = layer.experts.expert_weight_shards(local_slot, grad=True)
        full = out.setdefault(expert, {"gate": torch.zeros(F, H), "up": torch.zeros(F, H), "down": torch.zeros(H, F)})
        full["gate"][lo:hi] += grads["gate"]
        full["up"][lo:hi] += grads["up"]
        full["down"][:, lo:hi] += grads["down"]
    return out


def _reference(config: MoEConfig, x, dy):
    """The single-rank layer without replicas (same seed), its output and gradients."""
    torch.manual_seed(7)
    ref = MoELayer(MoEConfig(**{**config.__dict__, "num_expert_slots": E, "dispatcher": "alltoall",
                                "input_sharded": False, "expert_backend": "loop"}))
    xr = x.clone().requires_grad_()
    out, aux = ref(xr)
    out.backward(dy)
    return ref, out.detach(), xr.grad


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.allclose(a, b, atol=ATOL, rtol=1e-4), f"{what}: max diff {(a - b).abs().max().item():.3e}"


def _check_layer(state, config: MoEConfig, check_comms: bool):
    x, dy = _inputs()
    ref, ref_out, ref_dx = _reference(config, x, dy)
    ep_g, etp_g, group_g = state.ep.group, state.etp.group, state.ep_etp.group

    torch.manual_seed(7)
    layer = MoELayer(config, ep_group=ep_g, etp_group=etp_g, expert_group=group_g)
    # Initialisation is layout-invariant: each slot holds its expert's reference weights.
    for local_slot, slot in enumerate(layer.local_slots):
        mine = layer.experts.expert_weight_shards(local_slot)
        full = ref.experts.expert_weight_shards(int(layer.placement.slot_to_expert[slot]))
        shard_f = F // layer.etp_size
        sl = slice(layer.etp_rank * shard_f, (layer.etp_rank + 1) * shard_f)
        _close(mine["gate"], full["gate"][sl], "init gate")
        _close(mine["down"], full["down"][:, sl], "init down")
    _close(layer.router.weight, ref.router.weight, "init router")

    # Which tokens this rank holds, and which group must sum the replicated-parameter gradients.
    if config.dispatcher == "alltoall":
        token_rank, token_ranks, sum_group = state.ep.rank, state.ep.size, ep_g
    elif config.input_sharded:
        token_rank, token_ranks, sum_group = state.ep_etp.rank, state.ep_etp.size, group_g
    else:
        token_rank, token_ranks, sum_group = 0, 1, None
    rows = slice(token_rank * T // token_ranks, (token_rank + 1) * T // token_ranks)

    x_local = x[rows].clone().requires_grad_()
    with comms.comm_counter() as fwd, count_host_reads() as forward_reads:
        out, _ = layer(x_local)
    with comms.comm_counter() as bwd, count_host_reads() as backward_reads:
        out.backward(dy[rows])
    # One host read per layer forward (a sync on accelerators): the split sizes and rows per slot, together.
    assert len(forward_reads) == 1 and not backward_reads, (forward_reads, backward_reads)
    _close(out, ref_out[rows], "output")
    _close(x_local.grad, ref_dx[rows], "input grad")

    def summed(t):
        t = t.detach().clone()
        if sum_group is not None:
            dist.all_reduce(t, group=sum_group)
        return t

    _close(summed(layer.router.weight.grad), ref.router.weight.grad, "router grad")
    _close(summed(layer.shared_experts.gate_weight.grad), ref.shared_experts.gate_weight.grad, "shared gate grad")
    # Shared experts run on the dispatcher's token view: every token for all-gather, this rank's tokens
    # for all-to-all (whose EP ranks hold different tokens, like data-parallel ranks).
    shared_sum_group = ep_g if config.dispatcher == "alltoall" else None
    shard_group_size = comms.group_size(layer.dispatcher.reduce_group)
    shard_rank = comms.group_rank(layer.dispatcher.reduce_group)
    for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        expected = getattr(ref.shared_experts, name).grad.chunk(shard_group_size, dim=dim)[shard_rank]
        grad = getattr(layer.shared_experts, name).grad.clone()
        if shared_sum_group is not None:
            dist.all_reduce(grad, group=shared_sum_group)
        _close(grad, expected, f"shared {name} grad")

    # Expert gradients: sum over every replica and ETP shard of the expert group.
    mine = _expert_grads(layer)
    for expert in range(E):
        for name in ("gate", "up", "down"):
            total = mine.get(expert, {}).get(name)
            total = torch.zeros_like(ref.experts.expert_weight_shards(0)[name]) if total is None else total
            if group_g is not None:
                dist.all_reduce(total, group=group_g)
            _close(total, ref.experts.expert_weight_shards(expert, grad=True)[name], f"expert {expert} {name} grad")

    # After the replica reduction every slot holds its expert's full (ETP-shard) gradient.
    layer.reduce_replica_grads()
    for local_slot, slot in enumerate(layer.local_slots):
        expert = int(layer.placement.slot_to_expert[slot])
        if layer.placement.replica_counts[expert] == 1:
            continue
        mine = layer.experts.expert_weight_shards(local_slot, grad=True)
        full = ref.experts.expert_weight_shards(expert, grad=True)
        shard_f = F // layer.etp_size
        sl = slice(layer.etp_rank * shard_f, (layer.etp_rank + 1) * shard_f)
        _close(mine["gate"], full["gate"][sl], f"replica slot {slot} of expert {expert}: summed gate grad")
        _close(mine["down"], full["down"][:, sl], f"replica slot {slot} of expert {expert}: summed down grad")

    if check_comms:
        _check_comm_volume(layer, config, state, x_local, fwd, bwd)


def _check_comm_volume(layer, config, state, x_local, fwd, bwd):
    reductions = fwd.calls("all_reduce") + fwd.calls("reduce_scatter")
    if config.dispatcher == "allgather":
        if state.ep_etp.size > 1:
            # ONE reduction per layer forward, whatever the number of experts.
            assert reductions == 1, fwd.kinds()
            kind = "reduce_scatter" if config.input_sharded else "all_reduce"
            assert fwd.calls(kind, state.ep_etp.group) == 1
            assert fwd.bytes(kind) == T * H * 4
            assert fwd.calls("all_to_all") == 0
        else:
            assert fwd.calls() == 0
        return
    if state.ep.size > 1:
        n_send, n_recv, metadata_bytes = _all_to_all_volume(layer, state, x_local)
        token_bytes = (n_send + n_recv) * H * 4                            # dispatch + return
        assert fwd.bytes("all_to_all") == token_bytes + metadata_bytes, (fwd.bytes("all_to_all"), n_send, n_recv)
        assert fwd.calls("all_to_all") == 5
    else:
        assert fwd.calls("all_to_all") == 0
    assert fwd.calls("all_reduce") == (1 if state.etp.size > 1 else 0)


def _all_to_all_volume(layer, state, x_local) -> tuple[int, int, int]:
    """EP > 1, all-to-all dispatcher: (rows this rank sends, rows it receives, bytes of the metadata exchanges)
    of one forward: each token goes once to each EP rank holding >= 1 of its selected slots."""
    with torch.no_grad():
        routing = layer.router(x_local)
        slots = layer.experts_to_slots(routing.expert_ids)
        dest = slots // layer.placement.slots_per_rank                      # [T_local, K]
        sends = torch.zeros(state.ep.size, x_local.shape[0], dtype=torch.bool)
        sends[dest.reshape(-1), torch.arange(x_local.shape[0]).repeat_interleave(K)] = True
        send_counts = sends.sum(dim=1)
    n_send = int(send_counts.sum())
    all_counts = [torch.zeros_like(send_counts) for _ in range(state.ep.size)]
    dist.all_gather(all_counts, send_counts, group=state.ep.group)
    n_recv = int(sum(c[state.ep.rank] for c in all_counts))
    # counts (tokens and pairs per slot for each rank), slot ids, weights
    return n_send, n_recv, state.ep.size * (1 + layer.placement.slots_per_rank) * 8 + n_send * K * (8 + 4)


def _check_autocast_exchanges_the_compute_dtype(state):
    """EP > 1, all-to-all, bf16 autocast over fp32 parameters and tokens: the tokens cross in bf16 both ways,
    and so do their gradients (2 bytes per element in all four exchanges; the routing weights and their
    gradients stay fp32). Before, the tokens crossed in fp32 and the experts cast them after the exchange:
    the dispatch and its backward moved 4 bytes per element."""
    x, dy = _inputs()
    rows = slice(state.ep.rank * T // state.ep.size, (state.ep.rank + 1) * T // state.ep.size)
    torch.manual_seed(7)
    layer = MoELayer(_config(2 * E, backend="torch", shared=False), ep_group=state.ep.group,
                     etp_group=state.etp.group, expert_group=state.ep_etp.group)
    x_local = x[rows].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), comms.comm_counter() as fwd:
        out, _ = layer(x_local)
    with comms.comm_counter() as bwd:
        out.backward(dy[rows].to(out.dtype))
    n_send, n_recv, metadata_bytes = _all_to_all_volume(layer, state, x_local)
    assert fwd.bytes("all_to_all") == (n_send + n_recv) * H * 2 + metadata_bytes, (fwd.bytes("all_to_all"), n_send)
    # combine's backward: the returned rows' gradients; dispatch's: the received rows' and weights' gradients
    assert bwd.bytes("all_to_all") == (n_send + n_recv) * H * 2 + n_recv * K * 4, (bwd.bytes("all_to_all"), n_recv)
    assert out.dtype == torch.bfloat16 and x_local.grad.dtype == torch.float32


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
