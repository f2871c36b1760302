"""What the layout tests compare after one backward: every parameter's synced gradient, by name for dense
parameters and by (layer, expert, weight kind) for experts (slots are placed differently under each layout),
and the tokens this rank counted in the expert loads (only where its counters hold tokens no other rank
counts)."""

from __future__ import annotations

from megamoe.models.gpt_moe import expert_token_replicas
from megamoe.models.sequence_parallel import counts_own_tokens
from megamoe.training.grad_sync import GradientSync


def synced_gradients(model, state):
    """Run the gradient sync of ``model`` (one stage, after its backward) and return ``(dense grads by
    name, expert grads by (layer id, expert, kind), tokens counted by this rank)``."""
    GradientSync(model, state, tied_params=model.tied_parameters(),
                 expert_token_replicas=expert_token_replicas(model.config, state)).sync()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if not getattr(p, "expert_parallel", False)}
    experts, counted = {}, 0
    for layer_id, layer in model.moe_layers().items():
        for local_slot, slot in enumerate(layer.local_slots):
            expert = int(layer.placement.slot_to_expert[slot])
            for kind, grad in layer.experts.expert_weight_shards(local_slot, grad=True).items():
                experts[(layer_id, expert, kind)] = grad.clone()
        if counts_own_tokens(model, state):
            counted += int(layer.load_counter.per_expert.sum())
    return grads, experts, counted
