"""Shared by tests/unit/test_expert_migration.py and tests/multirank/test_expert_migration.py: the builders and
constants of the expert migration tests."""

from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig

T, H, F, E, K = 16, 8, 8, 8, 2


def _config(num_slots, backend="torch", fp8=None):
    return MoEConfig(router=RouterConfig(hidden_size=H, num_experts=E, top_k=K, norm_topk_prob=True),
                     ffn_hidden_size=F, num_expert_slots=num_slots, expert_backend=backend, expert_fp8=fp8)
