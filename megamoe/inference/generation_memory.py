"""The memory generation needs at least on a rank, before anything is allocated: its pipeline stage's
parameters (expert slots included) and the KV caches :func:`~megamoe.inference.generation.generate`
gives every layer. ``examples/generate.py`` compares it with the machine's memory
(:mod:`megamoe.machine_memory`) and refuses what cannot fit, instead of an allocator traceback."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.models.config import GPTMoEConfig
from megamoe.pipeline.partition import partition_layers
from megamoe.models.stage_parameters import stage_parameters
from megamoe.transformer.mla import MLAConfig

__all__ = ["GenerationMemoryEstimate", "estimate_generation_memory"]


@dataclass(frozen=True)
class GenerationMemoryEstimate:
    """What a rank of the lightest pipeline stage holds at least to generate (a lower bound for every
    rank: the prefill's activations and the kernels' temporaries are left out)."""

    param_bytes: int                      # its stage's parameters, expert slots included
    expert_param_bytes: int               # of those, the routed experts' slots on this rank
    kv_cache_bytes: int                   # the KV caches of its layers, for every row and position

    @property
    def total(self) -> int:
        return self.param_bytes + self.kv_cache_bytes


def estimate_generation_memory(config: GPTMoEConfig, *, batch: int, sequence_length: int, tp: int = 1, pp: int = 1,
                               ep: int = 1, etp: int = 1, num_expert_slots: int | None = None,
                               dtype: torch.dtype = torch.float32) -> GenerationMemoryEstimate:
    """The parameters and KV caches of generating ``batch`` rows of ``sequence_length`` positions (the
    longest prompt + new tokens) under the layout: every layer's
    :class:`~megamoe.inference.kv_cache.StaticKVCache` has that length and holds GQA's keys and values
    (``kv_heads / min(tp, kv_heads)`` heads per rank) or MLA's latent and rope key (not split over TP)
    in ``dtype``, the parameters' dtype. Kept block-FP8 weights count one byte per element."""
    e = torch.empty((), dtype=dtype).element_size()
    weight_bytes = 1 if config.weight_quantization is not None else e
    attention = config.attention
    if isinstance(attention, MLAConfig):
        per_position = attention.kv_lora_rank + attention.qk_rope_head_dim
    else:
        kv = attention.num_key_value_heads
        per_position = 2 * (kv // min(tp, kv)) * attention.head_dim
    stages = []
    for stage, layer_ids in enumerate(partition_layers(config.num_layers, pp)):
        params = stage_parameters(config, tp=tp, pp=pp, pp_rank=stage, ep=ep, etp=etp,
                                  num_expert_slots=num_expert_slots)
        stages.append(GenerationMemoryEstimate(
            param_bytes=weight_bytes * sum(p.numel for p in params),
            expert_param_bytes=weight_bytes * sum(p.numel for p in params if p.expert),
            kv_cache_bytes=len(layer_ids) * batch * sequence_length * per_position * e))
    return min(stages, key=lambda estimate: estimate.total)
