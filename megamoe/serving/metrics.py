"""A snapshot of the engine's state and counters (what ``/metrics`` exports)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DataParallelRankMetrics", "EngineMetrics"]


@dataclass(frozen=True)
class DataParallelRankMetrics:
    """One data-parallel rank's state after the latest step that ran the model (data-parallel attention,
    :mod:`megamoe.serving.data_parallel`): its requests running and waiting, its KV blocks used and in its
    pool, and the tokens it computed in that step (0: it ran the empty forward while others worked)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    step_tokens: int


@dataclass(frozen=True)
class EngineMetrics:
    """Counters are totals since the engine started; token counts are in tokens.
    ``prefix_cache_queries``: tokens of admitted requests looked up in the prefix cache;
    ``prefix_cache_hits``: of those, the tokens found (not computed). ``prompt_tokens_computed``: tokens the
    model computed without producing a new token (prefill chunks, recomputation after preemption);
    ``expert_balancedness``: per MoE layer of this stage, mean / max load per EP rank under its placement, of
    the tokens routed since the start (1.0: even). Under data-parallel attention (on rank 0) the gauges and
    counters add up every data-parallel rank's, ``data_parallel`` lists each rank's state, and the expert
    balancedness is of rank 0's own tokens."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_computed: int
    generated_tokens: int
    preemptions: int
    spec_proposed: int = 0
    spec_accepted: int = 0
    expert_balancedness: dict[int, float] = field(default_factory=dict)
    data_parallel: tuple[DataParallelRankMetrics, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total
