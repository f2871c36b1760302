"""Shared by tests/unit/test_distributed_optimizer.py and tests/multirank/test_distributed_optimizer.py: the
builders and constants of the distributed optimizer tests."""

import torch

from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import AttentionConfig, RopeConfig

H, V, E, F, SEQ, GLOBAL_BATCH, MICRO_BATCH, STEPS, SAVE_AT = 32, 64, 4, 16, 8, 8, 2, 10, 5
REL_TOL = 1e-5          # fp32 over STEPS steps (the bound)
CLIP = 0.5              # below the tiny model's gradient norms: every step is clipped
SKEW = (0.0, 0.05, 0.0, 0.03)     # router bias: experts 1 and 3 hot, so a rebalancing round moves slots


def config(num_slots=None, dispatcher="alltoall", sequence_parallel=False) -> GPTMoEConfig:
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=2, tie_word_embeddings=True,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  rope=RopeConfig(dim=8)),
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=E, top_k=2, norm_topk_prob=True,
                                          aux_loss_coeff=0.01, use_expert_bias=True, expert_bias_update_rate=0.01),
                      ffn_hidden_size=F, num_expert_slots=num_slots, dispatcher=dispatcher,
                      expert_backend="torch"),
        moe_layer_ids=(0, 1), sequence_parallel=sequence_parallel)


def build_model(state, num_slots=None, dtype=None, dispatcher="alltoall", sequence_parallel=False) -> GPTMoEModel:
    model = GPTMoEModel(config(num_slots, dispatcher, sequence_parallel), state, dtype=dtype)
    initialize_parameters(model, seed=0)
    for layer_id, layer in model.moe_layers().items():
        layer.router.expert_bias.copy_(torch.tensor(SKEW).roll(layer_id))
    return model


def train_config(**kwargs) -> TrainConfig:
    return TrainConfig(lr=1e-2, grad_clip=CLIP, weight_decay=0.01, **kwargs)


def global_batch() -> torch.Tensor:
    return torch.randint(0, V, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))


def train(trainer: Trainer, steps: int) -> list[tuple[float, float]]:
    """(loss, grad norm) of ``steps`` steps on this rank's share of the same global batch."""
    state = trainer.state
    per_rank = GLOBAL_BATCH // state.dp_cp.size
    mine = global_batch()[state.dp_cp.rank * per_rank:(state.dp_cp.rank + 1) * per_rank]
    out = []
    for _ in range(steps):
        m = trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO_BATCH)])
        out.append((m.loss, m.grad_norm))
    return out


def _close(got, want, rel):
    return all(abs(g - w) <= rel * abs(w) + 1e-9 for g, w in zip(got, want))


def _single_process_trainer(**kwargs):
    from parallel_state import ParallelState
    state = ParallelState.single_process()
    return Trainer(build_model(state), state, train_config(**kwargs))
