"""Shared by tests/unit/test_eplb.py and tests/multirank/test_eplb.py: the builders and constants of the eplb tests."""

import torch

from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import Trainer
from megamoe.transformer import AttentionConfig, RopeConfig

H, V, E, SEQ, GLOBAL_BATCH, MICRO_BATCH, STEPS, INTERVAL = 32, 64, 8, 8, 8, 2, 15, 3
# Selection bias of the skewed router: experts 3-5 take more tokens (each layer its own, rolled by the
# layer id); they share an EP rank under the default placement (experts in slot order) of every layout
# below, so the rebalancer has work to do.
SKEW = (0.0, 0.0, 0.0, 0.02, 0.06, 0.04, 0.0, 0.0)


def skewed_config(dispatcher: str, num_slots: int) -> GPTMoEConfig:
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=2,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  rope=RopeConfig(dim=8)),
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=E, top_k=2, norm_topk_prob=True,
                                          aux_loss_coeff=0.01, use_expert_bias=True, expert_bias_update_rate=0.02),
                      ffn_hidden_size=16, num_expert_slots=num_slots, dispatcher=dispatcher, expert_backend="torch"),
        moe_layer_ids=(0, 1))


def skewed_model(state, dispatcher: str, num_slots: int) -> GPTMoEModel:
    model = GPTMoEModel(skewed_config(dispatcher, num_slots), state)
    initialize_parameters(model, seed=0)
    for layer_id, layer in model.moe_layers().items():
        layer.router.expert_bias.copy_(torch.tensor(SKEW).roll(layer_id))    # each layer its own hot experts
    return model


def global_batch() -> torch.Tensor:
    return torch.randint(0, V, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))


def train(trainer: Trainer, state, steps: int) -> list:
    """``steps`` steps on this rank's share of the same global batch; per step (loss, grad norm, report)."""
    per_rank = GLOBAL_BATCH // state.dp_cp.size
    mine = global_batch()[state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
    out = []
    for _ in range(steps):
        m = trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO_BATCH)])
        out.append((m.loss, m.grad_norm, m.eplb))
    return out
