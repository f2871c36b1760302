"""Shared by tests/unit/test_recompute.py and tests/multirank/test_recompute.py: the builders and constants of the
recompute tests."""

import torch

from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.tensor_parallel import initialize_parameters
from megamoe.transformer import AttentionConfig, MLAConfig, MLPConfig, RopeConfig
from megamoe.transformer.recompute import RecomputeConfig
from parallel_state import ParallelState

H, V, B, S = 32, 64, 2, 16
NONE = RecomputeConfig()


def attention_config(kind: str):
    if kind == "gqa":
        return AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               rope=RopeConfig(dim=8), qk_norm="per_head")
    return MLAConfig(hidden_size=H, num_attention_heads=4, q_lora_rank=12 if kind == "mla" else None, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                     rope=RopeConfig(dim=4, layout="interleaved"))


def model_config(attention="gqa", recompute=NONE, *, backend="torch", fp8=None, dispatcher="alltoall",
                 input_sharded=False, num_layers=3) -> GPTMoEConfig:
    """Layer 0 dense, the others MoE with a gated shared expert; aux, sequence-aux and z losses and the
    expert bias on, so that every side output of the router is exercised."""
    return GPTMoEConfig(
        family="custom", vocab_size=V, hidden_size=H, num_layers=num_layers, attention=attention_config(attention),
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=4, top_k=2, norm_topk_prob=True,
                                          aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01, z_loss_coeff=0.001,
                                          use_expert_bias=True, expert_bias_update_rate=0.01),
                      ffn_hidden_size=16, dispatcher=dispatcher, input_sharded=input_sharded, expert_backend=backend,
                      expert_fp8=fp8, shared_experts=SharedExpertsConfig(H, 16, gate=True)),
        moe_layer_ids=tuple(range(1, num_layers)), dense_mlp=MLPConfig(hidden_size=H, intermediate_size=48),
        recompute=recompute)


def tokens(seed=0, batch=B, seq=S) -> torch.Tensor:
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def build(config, state=None) -> GPTMoEModel:
    model = GPTMoEModel(config, state or ParallelState.single_process())
    initialize_parameters(model, seed=0)
    return model
