"""Shared by tests/unit/test_moe_folding.py and tests/multirank/test_moe_folding.py: the builders and constants of
the moe folding tests."""

from megamoe.models import GPTMoEConfig
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.transformer import AttentionConfig, RopeConfig
from megamoe.transformer.mlp import MLPConfig
from megamoe.transformer.recompute import RecomputeConfig

H, V, E, K, SEQ, BATCH = 32, 64, 4, 2, 8, 2


def config(sp: bool = False, recompute: bool = False) -> GPTMoEConfig:
    router = RouterConfig(hidden_size=H, num_experts=E, top_k=K, norm_topk_prob=True, aux_loss_coeff=0.01,
                          seq_aux_loss_coeff=0.01, z_loss_coeff=0.001)
    attention = AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                rope=RopeConfig(dim=8), qkv_bias=True, o_proj_bias=True)
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=2, attention=attention,
        moe=MoEConfig(router=router, ffn_hidden_size=16, dispatcher="alltoall", expert_backend="torch",
                      shared_experts=SharedExpertsConfig(hidden_size=H, ffn_hidden_size=16, gate=True)),
        moe_layer_ids=(0, 1), dense_mlp=MLPConfig(hidden_size=H, intermediate_size=32), sequence_parallel=sp,
        recompute=RecomputeConfig("selective", ("moe",)) if recompute else RecomputeConfig())
