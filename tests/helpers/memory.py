"""Shared by tests/unit/test_memory.py and tests/multirank/test_memory.py: the builders and constants of the memory
tests."""

from __future__ import annotations

import torch

from megamoe.models import GPTMoEConfig
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.transformer import AttentionConfig, RopeConfig

H, LAYERS, VOCAB, SEQ, MICRO = 32, 2, 64, 32, 2


def qwen3_like(**overrides) -> GPTMoEConfig:
    """GQA with per-head q/k norms, every layer MoE (top-2 of 4, no shared experts)."""
    return GPTMoEConfig(
        family="custom", vocab_size=VOCAB, hidden_size=H, num_layers=LAYERS,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  rope=RopeConfig(dim=8), qk_norm="per_head"),
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=4, top_k=2, norm_topk_prob=True,
                                          aux_loss_coeff=1e-2), ffn_hidden_size=16, expert_backend="torch"),
        moe_layer_ids=tuple(range(LAYERS)), **overrides)


def _batches(steps: int = 2):
    data = torch.randint(0, VOCAB, (steps, MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return [[(d[:, :-1].contiguous(), d[:, 1:].contiguous())] for d in data]
