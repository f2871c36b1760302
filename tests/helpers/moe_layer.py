"""Shared by tests/unit/test_moe_layer.py and tests/multirank/test_moe_layer.py: the builders and constants of the
moe layer tests."""

import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.host_values import count_host_reads
from megamoe.moe.moe_layer import MoEConfig, MoELayer
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig

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
