"""The engine's settings: KV-cache size and block size, the per-step token budget, the batch and queue
bounds, prefix caching, online expert rebalancing, and (for the scaled layouts) speculation and data-parallel
attention."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineConfig"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    """``kv_cache_memory``: bytes of the KV block pool (every layer of this stage together); None: the
    fraction ``kv_cache_memory_fraction`` of the device's free memory when the engine starts.
    ``max_num_batched_tokens``: the tokens one step computes (decode tokens first, then prefill chunks).
    ``max_num_seqs``: requests running at once. ``max_waiting``: requests queued before
    :class:`~megamoe.serving.errors.QueueFullError`. ``speculative_tokens``: MTP draft tokens per step.
    ``data_parallel_attention``: each data-parallel rank schedules its own requests over its own KV cache, and
    the MoE layers run expert-parallel across them (:mod:`megamoe.serving.data_parallel`: tp = pp = 1, no
    speculation); the sizes and bounds above are then per data-parallel rank.
    ``eplb_interval``: re-place the expert slots every that many engine steps from those steps' expert loads
    (:mod:`megamoe.serving.online_eplb`); 0: never."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.5
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    speculative_tokens: int = 0
    data_parallel_attention: bool = False
    eplb_interval: int = 0

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_waiting"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")
        if self.kv_cache_memory is not None and (not _is_int(self.kv_cache_memory) or self.kv_cache_memory < 1):
            raise ValueError(f"EngineConfig.kv_cache_memory must be a number of bytes >= 1, or None (a fraction of "
                             f"free memory), got {self.kv_cache_memory!r}")
        fraction = self.kv_cache_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"EngineConfig.kv_cache_memory_fraction must be in (0, 1], got {fraction!r}")
        if not _is_int(self.speculative_tokens) or self.speculative_tokens < 0:
            raise ValueError(f"EngineConfig.speculative_tokens must be an integer >= 0, got "
                             f"{self.speculative_tokens!r}")
        if not _is_int(self.eplb_interval) or self.eplb_interval < 0:
            raise ValueError(f"EngineConfig.eplb_interval must be an integer >= 0 (engine steps between expert "
                             f"rebalancing rounds; 0: off), got {self.eplb_interval!r}")
        for name in ("enable_prefix_caching", "data_parallel_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be True or False, got {getattr(self, name)!r}")
