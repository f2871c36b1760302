"""What ``/metrics`` serves, in Prometheus' text format (version 0.0.4): the engine's state (running and waiting
requests, KV blocks, prefix-cache hits, preemptions, speculation, per-layer expert balancedness; under
data-parallel attention each data-parallel rank's requests, KV blocks and step tokens) and the
server's own measurements (finished requests, generated tokens and tokens/s, time to first token and time per
output token histograms).

:class:`ServingStats` is written by the engine thread and read by the HTTP handlers: a lock guards it.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time

__all__ = ["Histogram", "ServingStats", "render_metrics"]

# Seconds: from a millisecond to a minute (TTFT), from a millisecond to ten seconds (TPOT).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
TOKENS_PER_SECOND_WINDOW_S = 10.0


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)       # the last: above every bucket (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        lines, total = [], 0
        for bound, count in zip(self.buckets, self.counts):
            total += count
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {total}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6g}",
                  f"{name}_count {self.count}"]
        return lines


class ServingStats:
    """The server's measurements of finished requests and generated tokens (thread-safe)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.finished = collections.Counter()          # finish reason -> requests
        self.rejected = collections.Counter()          # HTTP status -> requests refused before they ran
        self.generated_tokens = 0
        self._recent = collections.deque()             # (time, tokens) of the last TOKENS_PER_SECOND_WINDOW_S
        self._started = clock()

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def tokens(self, count: int) -> None:
        now = self._clock()
        with self._lock:
            self.generated_tokens += count
            self._recent.append((now, count))
            self._forget(now)

    def finish(self, reason: str, decode_seconds: float, tokens: int) -> None:
        """A request finished; ``decode_seconds``: from its first token to its last, over ``tokens`` tokens."""
        with self._lock:
            self.finished[reason] += 1
            if tokens > 1:
                self.tpot.observe(decode_seconds / (tokens - 1))

    def reject(self, status: int) -> None:
        with self._lock:
            self.rejected[status] += 1

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last TOKENS_PER_SECOND_WINDOW_S (or since the start)."""
        now = self._clock()
        with self._lock:
            self._forget(now)
            window = min(TOKENS_PER_SECOND_WINDOW_S, now - self._started)
            return sum(n for _, n in self._recent) / window if window > 0 else 0.0

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - TOKENS_PER_SECOND_WINDOW_S:
            self._recent.popleft()

    def snapshot_lines(self) -> list[str]:
        rate = self.tokens_per_second()
        with self._lock:
            lines = _metric("megamoe_requests_finished_total", "counter", "requests finished, by finish reason",
                            [(f'{{reason="{r}"}}', n) for r, n in sorted(self.finished.items())] or [("", 0)])
            lines += _metric("megamoe_requests_rejected_total", "counter",
                             "requests refused before they ran (429: queue full, 503: server failing), by status",
                             [(f'{{status="{s}"}}', n) for s, n in sorted(self.rejected.items())] or [("", 0)])
            lines += _metric("megamoe_generation_tokens_total", "counter", "tokens generated",
                             [("", self.generated_tokens)])
            lines += _metric("megamoe_generation_tokens_per_second", "gauge",
                             f"tokens generated per second over the last {TOKENS_PER_SECOND_WINDOW_S:g} s",
                             [("", rate)])
            lines += ["# HELP megamoe_time_to_first_token_seconds from a request's arrival to its first token",
                      "# TYPE megamoe_time_to_first_token_seconds histogram",
                      *self.ttft.lines("megamoe_time_to_first_token_seconds")]
            lines += ["# HELP megamoe_time_per_output_token_seconds a request's time per token after its first",
                      "# TYPE megamoe_time_per_output_token_seconds histogram",
                      *self.tpot.lines("megamoe_time_per_output_token_seconds")]
        return lines


def _metric(name: str, kind: str, help_text: str, samples) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
            *(f"{name}{labels} {_number(value)}" for labels, value in samples)]


def _number(value) -> str:
    return str(value) if isinstance(value, int) else f"{float(value):.6g}"


# The engine's metrics (megamoe.serving.EngineMetrics fields): (name, kind, help).
ENGINE_METRICS = (
    ("running", "gauge", "requests running (scheduled in the batch)"),
    ("waiting", "gauge", "requests waiting to be scheduled"),
    ("kv_blocks_used", "gauge", "KV-cache blocks in use"),
    ("kv_blocks_total", "gauge", "KV-cache blocks in the pool"),
    ("prefix_cache_queries", "counter", "prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits", "counter", "prompt tokens found in the prefix cache"),
    ("prompt_tokens_computed", "counter", "prompt tokens prefilled (prefix-cache hits excluded)"),
    ("generated_tokens", "counter", "tokens the engine generated"),
    ("preemptions", "counter", "requests preempted when the KV pool ran out"),
    ("spec_proposed", "counter", "MTP draft tokens proposed"),
    ("spec_accepted", "counter", "MTP draft tokens accepted"),
)


def render_metrics(engine_metrics, stats: ServingStats) -> str:
    """The Prometheus text of an ``EngineMetrics`` snapshot and the server's stats."""
    lines = []
    for field, kind, help_text in ENGINE_METRICS:
        lines += _metric(f"megamoe_{field}" + ("_total" if kind == "counter" else ""), kind, help_text,
                         [("", getattr(engine_metrics, field))])
    lines += _metric("megamoe_prefix_cache_hit_rate", "gauge", "prefix-cache hits over queries (tokens), since "
                     "the start", [("", engine_metrics.prefix_cache_hit_rate)])
    lines += _metric("megamoe_kv_cache_usage", "gauge", "KV-cache blocks used over the pool",
                     [("", engine_metrics.kv_cache_usage)])
    balance = engine_metrics.expert_balancedness
    lines += _metric("megamoe_expert_balancedness", "gauge",
                     "per MoE layer: mean over max expert-parallel rank load of the routed tokens (1.0: balanced)",
                     [(f'{{layer="{layer}"}}', value) for layer, value in sorted(balance.items())])
    lines += _data_parallel_lines(engine_metrics.data_parallel)
    return "\n".join(lines + stats.snapshot_lines()) + "\n"


# Per data-parallel rank (data-parallel attention): (DataParallelRankMetrics field, help).
DATA_PARALLEL_METRICS = (
    ("running", "requests running on the data-parallel rank"),
    ("waiting", "requests waiting on the data-parallel rank"),
    ("kv_blocks_used", "KV-cache blocks in use on the data-parallel rank"),
    ("kv_blocks_total", "KV-cache blocks in the data-parallel rank's pool"),
    ("step_tokens", "tokens the data-parallel rank computed in the latest step that ran the model (0: idle)"),
)


def _data_parallel_lines(ranks) -> list[str]:
    """``megamoe_dp_<field>{dp_rank="r"}`` gauges (none without data-parallel attention)."""
    lines = []
    for field, help_text in DATA_PARALLEL_METRICS if ranks else ():
        lines += _metric(f"megamoe_dp_{field}", "gauge", help_text,
                         [(f'{{dp_rank="{rank}"}}', getattr(state, field)) for rank, state in enumerate(ranks)])
    return lines
