"""Shared by tests/unit/test_sequence_parallel.py and tests/multirank/test_sequence_parallel.py: the builders and
constants of the sequence parallel tests."""

import torch

from megamoe.models import GPTMoEConfig
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.transformer import AttentionConfig, RopeConfig
from megamoe.transformer.mla import MLAConfig
from megamoe.transformer.mlp import MLPConfig

H, V, E, SEQ, BATCH = 32, 64, 4, 8, 2


def gqa() -> AttentionConfig:
    return AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           rope=RopeConfig(dim=8), qkv_bias=True, o_proj_bias=True, qk_norm="per_head")


def mla(q_lora_rank: int | None) -> MLAConfig:
    return MLAConfig(hidden_size=H, num_attention_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope=RopeConfig(dim=4),
                     attention_bias=True)


def config(attention, dispatcher: str, *, shared: bool = True, moe_layers=(1,), sp: bool = False,
           tie: bool = False) -> GPTMoEConfig:
    router = RouterConfig(hidden_size=H, num_experts=E, top_k=2, norm_topk_prob=True, aux_loss_coeff=0.01,
                          seq_aux_loss_coeff=0.01, z_loss_coeff=0.001)
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=2, attention=attention,
        moe=MoEConfig(router=router, ffn_hidden_size=16, dispatcher=dispatcher, expert_backend="torch",
                      shared_experts=SharedExpertsConfig(hidden_size=H, ffn_hidden_size=16, gate=True)
                      if shared else None),
        moe_layer_ids=moe_layers, dense_mlp=MLPConfig(hidden_size=H, intermediate_size=32, bias=True),
        tie_word_embeddings=tie, sequence_parallel=sp)


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (BATCH, SEQ + 1), generator=g)
    # Packed documents: row 0 holds documents of 3 and 5 tokens, row 1 one document.
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0] * SEQ])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(SEQ))])
    return ids[:, :-1], ids[:, 1:], position_ids, document_ids
