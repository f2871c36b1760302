"""Shared by tests/unit/test_context_parallel.py and tests/multirank/test_context_parallel.py: the builders and
constants of the context parallel tests."""

from megamoe.models import GPTMoEConfig
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.transformer import AttentionConfig, MLAConfig, RopeConfig
from megamoe.transformer.mlp import MLPConfig
from megamoe.transformer.recompute import RecomputeConfig

H, V, E, K, SEQ, BATCH = 32, 64, 4, 2, 8, 2
KV_HEADS, HEAD_DIM, KV_LORA, ROPE = 2, 8, 8, 4


def config(kind: str, dispatcher: str = "alltoall", sp: bool = False,
           recompute: RecomputeConfig | None = None) -> GPTMoEConfig:
    router = RouterConfig(hidden_size=H, num_experts=E, top_k=K, norm_topk_prob=True, aux_loss_coeff=0.01,
                          seq_aux_loss_coeff=0.01, z_loss_coeff=0.001)
    if kind == "gqa":
        attention = AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                                    head_dim=HEAD_DIM, rope=RopeConfig(dim=HEAD_DIM), qkv_bias=True)
    else:
        attention = MLAConfig(hidden_size=H, num_attention_heads=4, q_lora_rank=8, kv_lora_rank=KV_LORA,
                              qk_nope_head_dim=8, qk_rope_head_dim=ROPE, v_head_dim=8, rope=RopeConfig(dim=ROPE))
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=2, attention=attention,
        moe=MoEConfig(router=router, ffn_hidden_size=16, dispatcher=dispatcher, expert_backend="torch",
                      shared_experts=SharedExpertsConfig(hidden_size=H, ffn_hidden_size=16, gate=True)),
        moe_layer_ids=(1,), dense_mlp=MLPConfig(hidden_size=H, intermediate_size=32), sequence_parallel=sp,
        recompute=recompute or RecomputeConfig())
