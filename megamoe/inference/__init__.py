"""Inference: KV-cache generation (prefill, decode, sampling) under any parallel layout, expert-load
recording, pipeline-aware uncached forward passes, and greedy decoding drafted by the model's MTP layers."""

from megamoe.inference.expert_load import gather_expert_load, reset_expert_load
from megamoe.inference.generation import GenerationConfig, GenerationOutput, generate
from megamoe.inference.kv_cache import StaticKVCache
from megamoe.inference.mtp_draft import MTPDraftOutput, generate_with_mtp_draft
from megamoe.inference.sampling import SamplingConfig, request_generator, sample_next_tokens

__all__ = [
    "GenerationConfig", "GenerationOutput", "generate", "SamplingConfig", "request_generator", "sample_next_tokens",
    "StaticKVCache", "gather_expert_load", "reset_expert_load", "MTPDraftOutput", "generate_with_mtp_draft",
]
