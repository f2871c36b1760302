"""Transformer building blocks (non-MoE): norms, RoPE, GQA attention, MLA, dense MLP, activation recomputation,
context parallelism's sequence layout.

Each block is a plain nn.Module taking its tensor-parallel group explicitly (``None``: one rank),
with HuggingFace parameter names so checkpoint conversion is a key map.
"""

from megamoe.transformer.attention import Attention, AttentionConfig, KVCache, causal_attention
from megamoe.transformer.context_parallel import cp_token_index, slice_for_context_parallel
from megamoe.transformer.mla import MLAConfig, MultiHeadLatentAttention
from megamoe.transformer.mlp import MLP, MLPConfig
from megamoe.transformer.norm import RMSNorm
from megamoe.transformer.recompute import RecomputeConfig
from megamoe.transformer.rope import RopeConfig, RotaryEmbedding, apply_rotary

__all__ = [
    "Attention", "AttentionConfig", "KVCache", "causal_attention", "MLAConfig", "MultiHeadLatentAttention",
    "MLP", "MLPConfig", "RMSNorm", "RecomputeConfig", "RopeConfig", "RotaryEmbedding", "apply_rotary",
    "cp_token_index", "slice_for_context_parallel",
]
