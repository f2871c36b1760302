"""The tiny MoE model most tests train (4 experts, top-2, shared experts, a dense first layer): its config
builder, sizes and global batches. Shared by tests of both tiers and by the scripts in tests/helpers/."""

import torch

from megamoe.models import GPTMoEConfig
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.transformer import AttentionConfig, MLPConfig, RopeConfig

H, V, E, S, GLOBAL_BATCH, MICRO_BATCH, STEPS = 32, 64, 4, 12, 8, 2, 3
REL_TOL = 1e-5          # fp32 over STEPS steps


def tiny_config(dispatcher="alltoall", num_slots=None, num_layers=4) -> GPTMoEConfig:
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=num_layers,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  rope=RopeConfig(dim=8), qk_norm="per_head"),
        moe=MoEConfig(
            router=RouterConfig(hidden_size=H, num_experts=E, top_k=2, norm_topk_prob=True, aux_loss_coeff=0.01,
                                use_expert_bias=True, expert_bias_update_rate=0.01),
            ffn_hidden_size=16, num_expert_slots=num_slots, dispatcher=dispatcher, expert_backend="torch",
            shared_experts=SharedExpertsConfig(H, 16, gate=True)),
        moe_layer_ids=tuple(range(1, num_layers)), dense_mlp=MLPConfig(hidden_size=H, intermediate_size=64))


def global_batches(steps=STEPS):
    """The same global batch every step: the loss then falls visibly within a few steps."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, V, (1, GLOBAL_BATCH, S + 1), generator=g).expand(steps, -1, -1)
