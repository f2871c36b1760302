"""Shared by tests/unit/test_step_metrics.py and tests/multirank/test_step_metrics.py: the builders and constants of
the step metrics tests."""

import torch

from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import AttentionConfig, MLPConfig, RopeConfig

H, V, E, TOP_K, S, GLOBAL_BATCH, MICRO_BATCH = 32, 64, 4, 2, 12, 8, 2
MOE_LAYERS = (1, 2, 3)


def _config(dispatcher="alltoall") -> GPTMoEConfig:
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=4,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  rope=RopeConfig(dim=8)),
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=E, top_k=TOP_K, aux_loss_coeff=0.01,
                                          z_loss_coeff=0.001),
                      ffn_hidden_size=16, dispatcher=dispatcher, expert_backend="torch"),
        moe_layer_ids=MOE_LAYERS, dense_mlp=MLPConfig(hidden_size=H, intermediate_size=48))


def _batch():
    return torch.randint(0, V, (GLOBAL_BATCH, S + 1), generator=torch.Generator().manual_seed(7))


def _step(state, world_group=None, dispatcher="alltoall", peak_tflops=None):
    """Metrics of one training step on this rank's share of the global batch, plus the trainer."""
    model = GPTMoEModel(_config(dispatcher), state)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(lr=1e-2), world_group=world_group, peak_tflops=peak_tflops)
    per_rank = GLOBAL_BATCH // state.dp_cp.size
    mine = _batch()[state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
    return trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO_BATCH)]), trainer
